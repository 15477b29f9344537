"""NVIDIA GPUs through torch's built-in CUDA support."""

from __future__ import annotations

import os
from typing import Any

import torch

from portatrain.accelerators.base import Accelerator, lookup_peak_tflops

# Dense peak TFLOP/s per GPU (no 2:4 sparsity), from NVIDIA's datasheets. The tensor-core columns
# there are printed "with sparsity"; dense is half. The fp32 column is the non-tensor-core rate
# (what an fp32 matmul gets unless TF32 is enabled). Rows are matched against
# torch.cuda.get_device_name(), specific before general ("NVIDIA H100 80GB HBM3" is the SXM part).
#   A100:        nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf (same for SXM4/PCIe, 40/80 GB)
#   H100:        NVIDIA H100 Tensor Core GPU datasheet (SXM, PCIe and NVL columns)
#   H200:        NVIDIA H200 Tensor Core GPU datasheet (SXM and NVL columns); the GH200 superchip's
#                GPU has the same peak as H200 SXM and its name ("NVIDIA GH200 ...") matches that row.
# Cross-checked against torchtitan's get_peak_flops (A100 312, H100 SXM 989, PCIe 756, NVL 835, H200 989;
# it rounds the halves down).
CUDA_PEAK_TFLOPS: tuple[tuple[tuple[str, ...], dict[str, float]], ...] = (
    (("H100 PCIe",), {"bfloat16": 756.5, "float16": 756.5, "tf32": 378.0, "float32": 51.0}),
    (("H100 NVL",), {"bfloat16": 835.5, "float16": 835.5, "tf32": 417.5, "float32": 60.0}),
    (("H100",), {"bfloat16": 989.5, "float16": 989.5, "tf32": 494.5, "float32": 67.0}),
    (("H200 NVL",), {"bfloat16": 835.5, "float16": 835.5, "tf32": 417.5, "float32": 60.0}),
    (("H200",), {"bfloat16": 989.5, "float16": 989.5, "tf32": 494.5, "float32": 67.0}),
    (("A100",), {"bfloat16": 312.0, "float16": 312.0, "tf32": 156.0, "float32": 19.5}),
)


class CUDAAccelerator(Accelerator):
    name = "cuda"
    device_type = "cuda"
    install_hint = (
        "install a CUDA build of torch on a machine with an NVIDIA GPU and driver, or pick device=cpu"
    )
    # gloo stays registered for CPU tensors (object collectives, DCP metadata).
    dist_backend = "cpu:gloo,cuda:nccl"
    compile_backend = "inductor"
    fused_adamw = True
    pinned_staging = True
    deterministic_kernels = True

    def make_deterministic(self, compile_backend: str | None) -> str | None:
        """cuBLAS repeats its results only with a fixed workspace (``CUBLAS_WORKSPACE_CONFIG``, read
        when a cuBLAS handle is created: before the first matmul), and cuDNN only without benchmarking
        its algorithms (https://pytorch.org/docs/stable/notes/randomness.html,
        https://docs.nvidia.com/cuda/cublas/#results-reproducibility). A value set by the user is kept."""
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.backends.cudnn.benchmark = False
        return super().make_deterministic(compile_backend)

    def unavailable_reason(self) -> str | None:
        if not torch.cuda.is_available():
            built = torch.version.cuda
            return f"torch.cuda.is_available() is False (torch {torch.__version__}, built with CUDA {built})"
        if torch.cuda.device_count() <= self.index:
            return f"{torch.cuda.device_count()} CUDA device(s) visible, need index {self.index}"
        return None

    def device_count(self) -> int:
        return torch.cuda.device_count()

    def get_rng_state(self) -> dict[str, Any]:
        # torch.cuda's RNG functions are public and initialize CUDA lazily; the generic base reads
        # torch.cuda.default_generators, which stays empty until CUDA is initialized.
        return {"cpu": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state(self.index)}

    def set_rng_state(self, state: dict[str, Any]) -> None:
        torch.set_rng_state(state["cpu"])
        if "cuda" in state:
            torch.cuda.set_rng_state(state["cuda"], self.index)

    def device_name(self) -> str:
        return torch.cuda.get_device_name(self.index)

    def low_precision_matmuls(self) -> dict[str, str]:
        """FP8 from sm89 (Ada, Hopper: FP8 tensor cores, what ``torch._scaled_mm`` needs), MXFP8 on
        sm10x (Blackwell B200/GB200: block-scaled tensor cores; pytorch/torchtitan ``docs/mxfp8.md``,
        "Requirements: NVIDIA B200 (SM100)"), the checks torchtitan makes (``has_cuda_capability(8, 9)``
        and ``(10, 0)`` in ``torchtitan/components/quantization/float8.py`` and ``mx.py``). ROCm: FP8
        on MI300 (gfx942, capability 9.4) and later (``has_rocm_capability(9, 4)`` there), whose e4m3
        variant (``float8_e4m3fnuz``) torchao picks itself."""
        major, minor = torch.cuda.get_device_capability(self.index)
        if torch.version.hip:
            return {"float8": "native"} if (major, minor) >= (9, 4) else {}
        formats = {"float8": "native"} if (major, minor) >= (8, 9) else {}
        if major == 10:
            formats["mxfp8"] = "native"
        return formats

    def peak_flops(self, dtype: torch.dtype) -> float | None:
        precision = str(dtype).removeprefix("torch.")
        # fp32 matmuls run on tensor cores as TF32 once torch.set_float32_matmul_precision("high")
        # (or allow_tf32) is set; the peak is then the TF32 one, 7x the plain fp32 rate on H100.
        if dtype == torch.float32 and torch.get_float32_matmul_precision() != "highest":
            precision = "tf32"
        tflops = lookup_peak_tflops(CUDA_PEAK_TFLOPS, self.device_name(), precision)
        return None if tflops is None else tflops * 1e12

    def supports_grouped_mm(self, dtype: torch.dtype) -> bool:
        # The fast kernel is CUTLASS's bf16 grouped GEMM for sm90+ (pytorch/pytorch
        # aten/src/ATen/native/cuda/GroupedBlas.cpp); elsewhere torch loops on the host, after a
        # device-to-host copy of the offsets, which the layer's own loop does no worse.
        return dtype == torch.bfloat16 and torch.cuda.get_device_capability(self.index) >= (9, 0)
