"""Build the sim device's op-coverage profiles from the vendors' own material.

Writes ``src/portatrain/accelerators/sim/profiles/{tpu,neuron}.json`` (schema
``portatrain.op_profile/1``, read by :mod:`portatrain.accelerators.sim.op_profiles`). Each file
records its sources (name, version or commit, sha256 where a file was read) and how complete it is.

tpu
    TorchTPU's own aten kernel registrations, read from its wheel (``pip download --no-deps
    torch-tpu``; the wheel is never installed). The wheel's glue library for the installed torch
    (``torch_tpu/csrc/common/glue_<torch>/libpywrap_<torch>_common.so``) registers its kernels for
    PrivateUse1 when loaded; a throwaway subprocess loads it next to a stand-in PJRT plugin (a
    ``GetPjrtApi`` that returns NULL, built here with the C compiler: the library checks for a
    plugin at load time but never calls it) and lists every aten operator that then has a
    PrivateUse1 kernel. An operator without one reaches TorchTPU's backend fallback, which calls
    ``at::native::cpu_fallback`` when ``torch_tpu.execution_mode.enable_cpu_fallback`` is on and
    raises NotImplementedError otherwise (the messages in the library's strings say so).
neuron
    torch-xla's lowerings (``codegen/xla_native_functions.yaml`` of pytorch/xla at a pinned commit:
    every section that registers a kernel for the XLA key), the XLA path torch-neuronx runs on,
    checked against AWS's published torch-neuronx supported-operator list (every listed operator
    must be lowered). TorchNeuron's native eager backend publishes its per-operator table in the
    torch-neuronx repository (docs/torch_api_compatibility.md), which could not be read here; the
    profile says so.

Usage::

    pip download --no-deps torch-tpu -d /tmp/torch_tpu
    python scripts/build_op_profiles.py --tpu-wheel /tmp/torch_tpu/torch_tpu-*.whl \\
        --xla-functions /path/to/pytorch-xla/codegen/xla_native_functions.yaml --xla-commit <sha>

``--only tpu`` or ``--only neuron`` rebuilds one profile.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
import urllib.request
import zipfile
from pathlib import Path

import torch

OUT = Path(__file__).resolve().parents[1] / "src" / "portatrain" / "accelerators" / "sim" / "profiles"
SCHEMA = "portatrain.op_profile/1"
XLA_COMMIT = "41398bfff334fc8d3b1c00be6ea8cc5411f6d6bf"
XLA_FUNCTIONS_URL = "https://raw.githubusercontent.com/pytorch/xla/{commit}/codegen/xla_native_functions.yaml"
XLA_SECTIONS = ("full_codegen", "ir_gen", "supported", "symint", "autograd")
"""The yaml's sections that register a kernel for the XLA dispatch key (ir_gen ops are also hand
registered; see the yaml's own comments)."""

NEURON_DOCS_URL = (
    "https://awsdocs-neuron.readthedocs-hosted.com/en/latest/frameworks/torch/torch-neuronx/"
    "pytorch-neuron-supported-operators.html"
)
NEURON_DOCUMENTED = [
    "_s_where",
    "_softmax",
    "_softmax_backward_data",
    "_unsafe_view",
    "add",
    "addcdiv_",
    "addcmul",
    "addmm",
    "bernoulli_",
    "bmm",
    "constant_pad_nd",
    "div",
    "embedding",
    "embedding_dense_backward",
    "empty",
    "expand",
    "fill_",
    "index_select",
    "_log_softmax",
    "_log_softmax_backward_data",
    "lt",
    "mm",
    "mul",
    "native_batch_norm",
    "native_batch_norm_backward",
    "neg",
    "permute",
    "relu",
    "rsub",
    "select",
    "slice",
    "sqrt",
    "sum",
    "t",
    "tanh",
    "tanh_backward",
    "threshold_backward",
    "transpose",
    "unsqueeze",
    "view",
    "zero_",
]
"""The aten operators AWS lists as supported by torch-neuronx (the page above, Neuron SDK 2.29)."""
NEURON_COMPAT_TABLE = "https://github.com/aws-neuron/torch-neuronx/blob/main/docs/torch_api_compatibility.md"

STAND_IN_PJRT = "void* GetPjrtApi(void) { return 0; }\n"
LIST_REGISTRATIONS = """
import ctypes, json, sys
import torch
ctypes.CDLL(sys.argv[1], mode=ctypes.RTLD_GLOBAL)
ops = [op for op in torch._C._dispatch_get_all_op_names()
       if op.startswith("aten::") and torch._C._dispatch_has_kernel_for_dispatch_key(op, "PrivateUse1")]
print(json.dumps(sorted(ops)))
"""


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def base_names(ops: list[str]) -> list[str]:
    """``aten::mm.out`` -> ``aten::mm``, deduplicated and sorted."""
    return sorted({op.split(".", 1)[0] for op in ops})


def torch_tag() -> str:
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return f"{major}_{minor}_0"


def tpu_profile(wheel: Path) -> dict:
    """TorchTPU's PrivateUse1 registrations, from loading its glue library in a subprocess."""
    tag = torch_tag()
    member = f"torch_tpu/csrc/common/glue_{tag}/libpywrap_{tag}_common.so"
    with tempfile.TemporaryDirectory() as tmp, zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        if member not in names:
            glues = sorted({m.split("/")[3] for m in names if m.startswith("torch_tpu/csrc/common/glue_")})
            raise SystemExit(
                f"{wheel.name} has no glue for torch {torch.__version__} ({member}); it has {glues}"
            )
        archive.extract(member, tmp)
        archive.extract("torch_tpu/csrc/common/libxla_base.so", tmp)
        library = Path(tmp) / member
        stand_in = Path(tmp) / "stand_in_pjrt.so"
        (Path(tmp) / "stand_in_pjrt.c").write_text(STAND_IN_PJRT)
        subprocess.run(
            ["cc", "-shared", "-fPIC", "-o", str(stand_in), str(Path(tmp) / "stand_in_pjrt.c")], check=True
        )
        env = {**os.environ, "TPU_LIBRARY_PATH": str(stand_in)}
        result = subprocess.run(
            [sys.executable, "-c", LIST_REGISTRATIONS, str(library)],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
            check=True,
        )
        registered = json.loads(result.stdout.strip().splitlines()[-1])
        strings = subprocess.run(["strings", "-n", "12", str(library)], capture_output=True, text=True).stdout
    falls_back = "is not implemented for TPU. Falling back to CPU" in strings
    rejects = "is not implemented for TPU. Please file a feature request" in strings
    version = re.search(r"torch_tpu-([^-]+)-", wheel.name)
    return {
        "schema": SCHEMA,
        "name": "tpu",
        "backend": f"TorchTPU {version.group(1) if version else '?'} eager (torch_tpu, PrivateUse1 'tpu')",
        "sources": [
            {
                "what": f"the aten kernels torch_tpu registers for PrivateUse1, listed by the dispatcher after "
                f"loading {member} from the wheel (never installed) with torch {torch.__version__}",
                "where": "https://pypi.org/project/torch-tpu/",
                "file": wheel.name,
                "sha256": sha256(wheel),
            }
        ],
        "completeness": (
            f"complete for eager kernels registered by this wheel for torch {torch.__version__}: {len(registered)} "
            "aten overloads. Not covered: which dtypes or argument values a kernel accepts (a registered kernel "
            "can still raise for an unsupported dtype), and ops torch.compile lowers to XLA without an eager kernel. "
            "Matched by operator name, any overload."
        ),
        "unlisted": (
            "TorchTPU's backend fallback "
            + (
                "runs the op on the CPU (at::native::cpu_fallback, with a warning) when "
                "torch_tpu.execution_mode.enable_cpu_fallback is on"
                if falls_back
                else "falls back"
            )
            + (
                " and raises NotImplementedError ('... is not implemented for TPU') when it is off"
                if rejects
                else ""
            )
            + "; SIM_UNSUPPORTED_ACTION=error simulates the latter"
        ),
        "native": base_names(registered),
        "registered": registered,
        "generated_by": "scripts/build_op_profiles.py",
    }


def xla_lowered(text: str) -> list[str]:
    """The aten overloads a ``xla_native_functions.yaml`` registers for the XLA key."""
    ops, section = [], None
    for line in text.splitlines():
        header = re.match(r"^([a-z_]+):\s*$", line)
        if header:
            section = header.group(1)
            continue
        item = re.match(r"^\s+-\s+([A-Za-z0-9_.]+)\s*$", line)
        if item and section in XLA_SECTIONS:
            ops.append(f"aten::{item.group(1)}")
    return sorted(set(ops))


def neuron_profile(functions: str, commit: str) -> dict:
    """torch-xla's lowerings (the XLA path torch-neuronx runs on), checked against AWS's list."""
    if functions.startswith(("http://", "https://")):
        with urllib.request.urlopen(functions, timeout=60) as response:
            raw = response.read()
    else:
        raw = Path(functions).read_bytes()
    lowered = xla_lowered(raw.decode())
    names = base_names(lowered)
    # torch-xla functionalizes: an in-place op runs as its lowered functional form (add_ as add), a
    # view as its lowered *_copy form (transpose as transpose_copy).
    native = sorted(
        {
            *names,
            *(f"{op}_" for op in names),
            *(op.removesuffix("_copy") for op in names if op.endswith("_copy")),
        }
    )
    documented = sorted(f"aten::{op}" for op in NEURON_DOCUMENTED)
    not_lowered = [op for op in documented if op not in native]
    return {
        "schema": SCHEMA,
        "name": "neuron",
        "backend": f"torch-neuronx on torch-xla (XLA lowerings of pytorch/xla {commit[:12]})",
        "sources": [
            {
                "what": "torch-xla's lowerings: every operator of codegen/xla_native_functions.yaml in the sections "
                f"{', '.join(XLA_SECTIONS)}",
                "where": XLA_FUNCTIONS_URL.format(commit=commit),
                "sha256": hashlib.sha256(raw).hexdigest(),
            },
            {
                "what": f"AWS's torch-neuronx supported-operator list ({len(documented)} operators), each checked "
                "against the lowerings",
                "where": NEURON_DOCS_URL,
                "documented_but_not_lowered": ", ".join(not_lowered) or "none",
            },
        ],
        "completeness": (
            f"the XLA path: {len(lowered)} lowered overloads ({len(names)} operator names, {len(native)} with the "
            "in-place and view forms functionalization maps onto them) of torch-xla, which torch-neuronx compiles "
            "through neuronx-cc; an operator torch-xla lowers can still be rejected by the "
            "Neuron compiler. Not read: TorchNeuron's native eager backend's own per-operator table "
            f"({NEURON_COMPAT_TABLE}, not reachable when this profile was built). Matched by operator name, any overload."
        ),
        "unlisted": (
            "torch-xla runs an operator without a lowering on the CPU (xla_cpu_fallback, which calls "
            "at::native::cpu_fallback and counts it in torch_xla's metrics as aten::<op>)"
        ),
        "native": native,
        "registered": lowered,
        "generated_by": "scripts/build_op_profiles.py",
    }


def write(profile: dict) -> Path:
    path = OUT / f"{profile['name']}.json"
    path.write_text(json.dumps(profile, indent=1) + "\n")
    print(f"wrote {path} ({len(profile['native'])} native operator names)")
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tpu-wheel", type=Path, help="a downloaded torch_tpu wheel")
    parser.add_argument(
        "--xla-functions",
        default=None,
        help="pytorch/xla's codegen/xla_native_functions.yaml (a path or URL; default: the pinned commit's URL)",
    )
    parser.add_argument("--xla-commit", default=XLA_COMMIT, help="the pytorch/xla commit the yaml comes from")
    parser.add_argument("--only", choices=("tpu", "neuron"))
    args = parser.parse_args()
    if args.only in (None, "tpu"):
        if args.tpu_wheel is None:
            parser.error(
                "--tpu-wheel is needed for the tpu profile (pip download --no-deps torch-tpu -d DIR)"
            )
        write(tpu_profile(args.tpu_wheel))
    if args.only in (None, "neuron"):
        write(
            neuron_profile(
                args.xla_functions or XLA_FUNCTIONS_URL.format(commit=args.xla_commit), args.xla_commit
            )
        )


if __name__ == "__main__":
    main()
