"""Example engines: the servers the benchmarks and the GPU examples run inside capsules (not product code).

`engine_llama.py` (an 8B-shaped Llama that hands its weights to the hydration API, and `launch`, the capsule's small
init), `engine_tp.py` (a tensor-parallel rank over NCCL), `ttft_server.py` (a decoder-only toy server for the
restore-to-first-token bench), `split_server.py` (the same model behind a front end in another process, vLLM V1's
shape) and `serve_model.py` (the model folder `transformers serve` loads). Capsules mount this
folder read-only at `/opt/engine`; `bench/` only measures them.
"""
