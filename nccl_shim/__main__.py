"""`python -m nccl_shim inspect [--library PATH] [--in-place] [--require CAP,...] [--json]`.

Prints the provider identity, capabilities, in-place and resources status, and the admission
verdict. Exit status: 0 admitted, 3 not admitted, 2 usage errors.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import msgspec

from ._abi import CAPABILITY_BITS
from ._admission import Expectations, admit_identity, capability_names, unknown_capability_mask
from ._lib import Shim
from .errors import ProviderNotAdmitted, ShimError

EXIT_NOT_ADMITTED, EXIT_USAGE = 3, 2


def inspect(library: str | None, *, in_place: bool, require: list[str]) -> dict[str, Any]:
    report: dict[str, Any] = {"library": library, "admitted": False, "error": None, "rule": None}
    try:
        shim = Shim(library)
    except ShimError as exc:
        report["error"] = str(exc)
        return report
    try:
        identity = shim.identity()
        in_place_status = shim.in_place()
        report.update(identity=msgspec.to_builtins(identity), capabilities=capability_names(identity.capability_mask),
                      unknown_capability_mask=unknown_capability_mask(identity.capability_mask),
                      in_place=msgspec.to_builtins(in_place_status), resources=msgspec.to_builtins(shim.resources()))
        expect = Expectations.from_environment(extra_capabilities=require, in_place=in_place or None)
        admit_identity(identity, in_place_status, expect)
        report["admitted"] = True
    except ProviderNotAdmitted as exc:
        report.update(error=str(exc), rule=exc.rule)
    finally:
        shim.close()
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m nccl_shim")
    sub = parser.add_subparsers(dest="command", required=True)
    cmd = sub.add_parser("inspect", help="identity, capabilities, in-place status and admission verdict")
    cmd.add_argument("--library", help="provider library to open (default: the process-global namespace)")
    cmd.add_argument("--in-place", action="store_true", help="admit the in-place lifecycle too")
    cmd.add_argument("--require", default="", help="comma-separated capability names that must be present")
    cmd.add_argument("--json", action="store_true", help="one JSON object on stdout")
    args = parser.parse_args(argv)
    require = [name.strip() for name in args.require.split(",") if name.strip()]
    if unknown := sorted({n for n in require if n not in CAPABILITY_BITS}):
        sys.stderr.write(f"error: unknown required NCCL provider capabilities: {', '.join(unknown)}\n")
        return EXIT_USAGE
    report = inspect(args.library, in_place=args.in_place, require=require)
    if args.json:
        sys.stdout.write(json.dumps(report, sort_keys=True) + "\n")
    else:
        ident = report.get("identity") or {}
        lines = [f"library: {report['library'] or '<process-global namespace>'}",
                 f"provider: {ident.get('provider_id')} revision {ident.get('provider_revision')} "
                 f"(struct {ident.get('struct_size')} bytes, ABI {ident.get('abi_major')}.{ident.get('abi_minor')})",
                 f"NCCL compiled/loaded: {ident.get('compiled_nccl_version')}/{ident.get('loaded_nccl_version')}, "
                 f"checkpoint ABI {ident.get('checkpoint_abi_version')}",
                 f"capabilities: {', '.join(report.get('capabilities', [])) or '-'}",
                 f"in-place: {(report.get('in_place') or {}).get('status', '-')}",
                 f"resources: {(report.get('resources') or {}).get('status', '-')}",
                 f"admitted: {'yes' if report['admitted'] else 'no: ' + str(report['error'])}"]
        sys.stdout.write("\n".join(lines) + "\n")
    return 0 if report["admitted"] else EXIT_NOT_ADMITTED


if __name__ == "__main__":
    raise SystemExit(main())
