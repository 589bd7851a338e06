"""nccl_shim: a C shim over the NCCL provider ABIs and its Python binding."""

__all__: tuple[str, ...] = ()
