"""The static audit on CUDA-first training code: the rules that reason about device-type branches,
logging intervals' defaults, ``hasattr`` probes, evaluation loops and dict-valued outputs, each on
its fixture; and recall and false positives on held-out training scripts written in four styles
(``tests/fixtures/audit/heldout/``), against the CUDA-isms a careful reader marks in them.

The first four scripts were marked and audited while the rules were written: auditing them found
two misses and six false positives that four general fixes then closed (``nn.SyncBatchNorm``,
``attn_implementation`` as a dict entry, CUDA's own settings inside a CUDA-only branch,
``padding=1`` read as ``padding=True``). The fifth was written after the rules were final. Last,
real training code from two PyPI packages (``tests/fixtures/audit/unseen/``), marked by hand before
the audit first ran on it."""

from __future__ import annotations

from pathlib import Path

import pytest

from portatrain.audit import audit_paths, scan_source

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "audit"
HELDOUT = FIXTURES / "heldout"

# (rule, line) of every finding in each fixture.
EXPECTED: dict[str, set[tuple[str, int]]] = {
    "device_guards.py": {
        ("pin-memory-cuda", 12),  # x.pin_memory() under `if device_type == "cuda":`
        ("cuda-only-fast-path", 12),  # non_blocking=True, same branch
        ("feature-probe", 19),  # "fused" in inspect.signature(torch.optim.AdamW).parameters
        (
            "cuda-only-fast-path",
            21,
        ),  # dict(fused=True) if use_fused, use_fused = ... and device_type == "cuda"
        ("cuda-only-fast-path", 23),  # fused=(device_type == "cuda")
        ("cuda-only-fast-path", 28),  # non_blocking=device.type == "cuda"
        ("cuda-api", 58),  # torch.cuda.synchronize() under `if device.type == "cpu":`
        ("sync-batchnorm", 65),  # outside the CUDA branch
    },  # torch.cuda calls after `if device.type != "cuda": return`, under `if is_cuda`, `x.is_cuda`: none
    "logging_defaults.py": {
        ("host-sync", 18),  # `it % log_interval`, log_interval = 1 at module level
        ("host-sync", 34),  # `args.log_every`, add_argument("--log-every", default=1)
        ("host-sync", 51),  # `cfg.log_steps`, a dataclass field defaulting to 1
    },
    "probes.py": {
        ("feature-probe", 14),  # hasattr(torch.nn.functional, "scaled_dot_product_attention")
        ("feature-probe", 15),  # hasattr(F, ...)
        ("manual-attention", 21),  # the fallback the probe keeps
        ("feature-probe", 26),  # "fused" in inspect.signature(...).parameters
    },
    "evaluation.py": {
        ("eval-host-copy", 11),  # predictions.append(logits.argmax(-1).cpu())
        ("eval-host-copy", 12),  # labels.extend(y.tolist())
        ("eval-host-copy", 20),  # .to("cpu").numpy()
        ("eval-host-copy", 26),  # [net(x).cpu() for x in loader] under inference_mode
        ("host-sync", 35),  # total += cross_entropy(...).item(), once per batch
    },
    "backend_tables.py": {
        ("nccl-backend-map", 5),  # {"cuda": "nccl", "cpu": "gloo"}
        ("nccl-backend-map", 13),  # "nccl" if device.type == "cuda" else "gloo"
        ("nccl-backend", 18),  # backend="nccl"
    },
    "dict_outputs.py": {("tensor-control-flow", 17)},  # logits.isnan().any(); not `"logit_bias" in model_out`
    # Issue 40's missed shapes; each fixture ends with clean negatives.
    "implicit_cuda.py": {
        ("nccl-setting", 6),  # import torch.cuda.nccl as nccl
        ("nccl-setting", 11),  # os.environ["NCCL_ASYNC_ERROR_HANDLING"] = "1"
        ("nccl-setting", 12),  # os.environ.setdefault("TORCH_NCCL_BLOCKING_WAIT", ...)
        ("cuda-default-device", 13),  # ShardedGradScaler()
        ("cuda-default-device", 14),  # torch.amp.GradScaler()
        ("cuda-library", 15),  # BitsAndBytesConfig(load_in_4bit=True, ...), one finding
        ("cuda-library", 20),  # from_pretrained(..., load_in_8bit=True)
        ("cuda-default-device", 26),  # batch[key].to(local_rank)
        ("cuda-default-device", 27),  # .to(args.gpu)
        ("cuda-profiler", 32),  # ProfilerActivity.CUDA
        ("cuda-profiler", 34),  # sort_by="self_cuda_time_total"
        ("cuda-api", 35),  # nccl.version()
    },
    "host_reads.py": {
        ("host-sync", 19),  # wandb.log({"train/loss": loss.detach().float()}) every step
        ("host-sync", 21),  # under `step % self.log_interval`, __init__(log_interval=1)
        ("host-sync", 25),  # moved.sum().item(): moved to the device first
        ("host-sync", 33),  # val_loss.append(loss.item()) per evaluation batch
        ("host-sync", 34),  # float(torch.exp(loss)) per evaluation batch
    },  # not lengths.sum().item() / counts.mean().item(): tensors still on the host
    "cross_module": {  # a folder: trainer/train.py calls helpers of trainer/utils.py
        ("cuda-api", 9),  # utils.py: torch.cuda.empty_cache()
        ("cuda-helper", 10),  # train.py: gc_cuda()
        ("cuda-helper", 11),  # train.py: utils.peak_gpu_memory()
        ("cuda-helper", 12),  # train.py: log_memory() (relative import; calls peak_gpu_memory)
        ("cuda-api", 13),  # utils.py: torch.cuda.max_memory_allocated()
    },  # not on_device() (CUDA-only branch), portable(), torch.manual_seed
}


def _found(path: Path) -> set[tuple[str, int]]:
    return {(f.rule, f.line) for f in audit_paths([path]).findings}


@pytest.mark.parametrize("fixture", sorted(EXPECTED))
def test_fixture_findings_are_exact(fixture: str) -> None:
    assert _found(FIXTURES / fixture) == EXPECTED[fixture]


@pytest.mark.parametrize("fixture", sorted(EXPECTED))
def test_each_finding_keeps_its_one_line_fix(fixture: str) -> None:
    for finding in audit_paths([FIXTURES / fixture]).findings:
        assert finding.replacement and "\n" not in finding.replacement, finding
        assert finding.message and "\n" not in finding.message, finding


def test_the_every_step_gate_says_why() -> None:
    finding = next(f for f in audit_paths([FIXTURES / "logging_defaults.py"]).findings if f.line == 34)
    assert "`args.log_every` defaults to 1" in finding.message
    assert "default above 1" in finding.replacement


def test_a_cross_module_finding_names_the_helpers_cuda_line() -> None:
    folder = FIXTURES / "cross_module"
    findings = {f.line: f for f in audit_paths([folder]).findings if f.rule == "cuda-helper"}
    assert findings[10].message.startswith("`gc_cuda()` calls `torch.cuda.empty_cache()` at ")
    assert findings[10].message.endswith("cross_module/trainer/utils.py:9")
    assert "which calls `torch.cuda.max_memory_allocated()`" in findings[12].message
    # One file alone is not a project: its calls into helpers it cannot see stay unreported.
    alone = audit_paths([folder / "trainer" / "train.py"]).findings
    assert [f for f in alone if f.rule == "cuda-helper"] == []


def test_guards_follow_assignments_negations_and_early_exits() -> None:
    source = """
import torch

def a(device):
    on_gpu = device.type == "cuda"
    if on_gpu:
        torch.cuda.synchronize()
    if not on_gpu:
        torch.cuda.synchronize()

def b(device_type):
    if device_type != "cuda" or not torch.distributed.is_initialized():
        return
    torch.cuda.synchronize()

def c(device_type):
    if device_type == "cuda" and torch.cuda.is_available():
        pass
    else:
        torch.cuda.synchronize()
"""
    assert [(f.rule, f.line) for f in scan_source(source)] == [
        ("cuda-api", 9),  # `not on_gpu`: the branch CUDA never takes
        ("cuda-device-branch", 17),  # torch.cuda.is_available() is still a device choice
        ("cuda-api", 20),  # the else of a conjunction: not only CUDA
    ]


def test_a_dict_valued_name_is_no_tensor_but_its_entries_are() -> None:
    source = """
def train(model, optimizer, loader):
    for batch in loader:
        out = model(batch)
        if out:
            pass
        if out["loss"] > 10:
            pass
        out["loss"].backward()
        optimizer.step()
"""
    assert [(f.rule, f.line) for f in scan_source(source)] == [("tensor-control-flow", 7)]
    # The same truth test on a model output that is not read as a dict is still reported.
    assert [f.line for f in scan_source(source.replace('out["loss"]', "out"))] == [5, 7]


# -- held-out scripts -------------------------------------------------------------------------------
# What a careful reader marks in each script, by rule and by the text of the marked line (the first
# line containing it). `cuda` marks are CUDA-isms (they break, slow down or silently change off
# NVIDIA); `other` marks are true findings of other kinds (unsafe checkpoints); `missed` marks are
# CUDA-isms no rule finds yet (they count against recall). A scalar `.item()` per evaluation batch
# was deliberately not marked until the rules read evaluation loops' scalar reads (issue 40); those
# marks were added then. Deliberately not marked: `fused=True`/`non_blocking=True` switched on for
# every device, and CUDA-only code inside a branch only CUDA takes.
HELDOUT_MARKS: dict[str, dict[str, list[tuple[str, str]]]] = {
    "gpt_single_file.py": {  # a nanoGPT-like single file: globals as config, DDP under torchrun
        "cuda": [
            ("nccl-backend", 'backend = "nccl"'),
            ("cuda-device-string", 'device = "cuda"'),
            ("cuda-device-branch", 'dtype = "bfloat16" if torch.cuda.is_available()'),
            ("feature-probe", 'self.flash = hasattr(torch.nn.functional, "scaled_dot_product_attention")'),
            ("manual-attention", "att = F.softmax(att, dim=-1)"),
            ("cuda-only-fast-path", "extra_args = dict(fused=True) if use_fused"),
            ("cuda-device-string", 'device = f"cuda:{ddp_local_rank}"'),
            ("cuda-set-device", "torch.cuda.set_device(device)"),
            ("cuda-backend-flag", "torch.backends.cuda.matmul.allow_tf32 = True"),
            ("cuda-backend-flag", "torch.backends.cudnn.allow_tf32 = True"),
            ("cuda-device-branch", 'device_type = "cuda" if "cuda" in device else "cpu"'),
            ("pin-memory-cuda", "x, y = x.pin_memory().to(device, non_blocking=True)"),
            ("cuda-only-fast-path", "x, y = x.pin_memory().to(device, non_blocking=True)"),
            ("cuda-amp", "scaler = torch.cuda.amp.GradScaler("),
            ("ddp-device-ids", "model = DDP(model, device_ids=[ddp_local_rank])"),
            ("host-sync", "lossf = loss.item() * gradient_accumulation_steps"),  # log_interval = 1
            ("host-sync", "losses[k] = loss.item()"),  # once per evaluation batch
        ],
        "other": [("torch-load-implicit", "checkpoint = torch.load(")],
    },
    "finetune_classifier.py": {  # a Trainer-less Hugging Face fine-tune loop
        "cuda": [
            ("cuda-api", "torch.cuda.manual_seed_all(seed)"),
            ("host-sync", "total_loss += outputs.loss.item()"),  # once per evaluation batch
            ("pad-to-batch-max", 'padding="longest"'),
            ("pin-memory-cuda", "pin_memory=True"),
            ("eval-host-copy", "all_preds.append(outputs.logits.argmax(dim=-1).cpu().numpy())"),
            ("eval-host-copy", 'all_labels.append(batch["labels"].cpu().numpy())'),
            ("cuda-device-branch", 'device = torch.device("cuda" if torch.cuda.is_available()'),
            ("cuda-api", "torch.cuda.device_count()"),
            ("cuda-library", 'model_kwargs["attn_implementation"] = "flash_attention_2"'),
            ("cuda-amp", "scaler = torch.cuda.amp.GradScaler("),
            ("cuda-amp", "with torch.cuda.amp.autocast("),
            ("host-sync", "progress.set_postfix(loss=loss.item()"),
            ("cuda-api", "torch.cuda.empty_cache()"),
            ("cuda-device-branch", "if torch.cuda.is_available():"),
        ],
        "other": [],
    },
    "ddp_image_classifier.py": {  # a torchrun DDP image classifier with a per-device backend table
        "cuda": [
            ("nccl-backend-map", 'BACKENDS = {"cuda": "nccl", "cpu": "gloo"}'),
            ("cuda-device-branch", 'device_type = "cuda" if torch.cuda.is_available() else "cpu"'),
            ("pin-memory-cuda", "pin_memory=True,"),
            ("pin-memory-cuda", "sampler=val_sampler, num_workers=args.workers, pin_memory=True"),
            ("cuda-call", "images = images.cuda(non_blocking=True)"),
            ("cuda-call", "target = target.cuda(non_blocking=True)"),
            ("cuda-device-string", 'with torch.autocast(device_type="cuda"'),
            ("host-sync", "losses.update(reduced_loss.item()"),
            ("host-sync", "top1.update(reduce_mean(acc1, world_size).item()"),
            ("cuda-api", "torch.cuda.synchronize()"),
            ("cuda-backend-flag", "torch.backends.cudnn.benchmark = True"),
            ("sync-batchnorm", "nn.SyncBatchNorm.convert_sync_batchnorm(model)"),
            ("cuda-device-string", 'scaler = torch.amp.GradScaler("cuda"'),
        ],
        "other": [],
    },
    "diffusion_unet.py": {  # a diffusion UNet: optional xformers, CUDA events, bf16 autocast, EMA
        "cuda": [
            ("cuda-library", "import xformers.ops as xops"),
            ("cuda-device-string", 'device = torch.device("cuda:0")'),
            ("cuda-backend-flag", "torch.backends.cuda.matmul.allow_tf32 = True"),
            ("cuda-backend-flag", "torch.backends.cudnn.allow_tf32 = True"),
            ("pin-memory-cuda", "pin_memory=torch.cuda.is_available()"),
            ("cuda-api", "start = torch.cuda.Event(enable_timing=True)"),
            ("cuda-api", "end = torch.cuda.Event(enable_timing=True)"),
            ("cuda-device-string", 'with torch.autocast("cuda"'),
            ("tensor-control-flow", "if not torch.isfinite(grad_norm):"),
            ("cuda-api", "torch.cuda.synchronize()"),
        ],
        "other": [("pickle-dump", "pickle.dump(asdict(cfg), f)")],
    },
    # Written and marked after the rules above were final, and audited once: a truly held-out
    # script. Its two `.to(local_rank)` marks (a device index taken from the local rank, wrong where
    # each worker sees one device, as on TPU) were misses until `cuda-default-device` (issue 40).
    "fsdp_llama_pretrain.py": {  # FSDP (v1) pretraining of a Llama-style decoder under torchrun
        "cuda": [
            ("nccl-backend", 'dist.init_process_group("nccl")'),
            ("cuda-set-device", "torch.cuda.set_device(local_rank)"),
            ("cuda-api", "device_id=torch.cuda.current_device()"),
            ("cuda-api", "m.to_empty(device=torch.cuda.current_device()"),
            ("pin-memory-cuda", "pin_memory=True"),
            ("cuda-default-device", "inputs = inputs.to(local_rank, non_blocking=True)"),
            ("cuda-default-device", "targets = targets.to(local_rank, non_blocking=True)"),
            ("cuda-api", "mem = torch.cuda.max_memory_allocated()"),
            ("cuda-api", "torch.cuda.reset_peak_memory_stats()"),
        ],
        "other": [],
    },
}


def _marks(script: str, kind: str) -> set[tuple[str, int]]:
    lines = (HELDOUT / script).read_text().splitlines()
    marks = set()
    for rule, text in HELDOUT_MARKS[script].get(kind, []):
        numbers = [i for i, line in enumerate(lines, 1) if text in line]
        assert numbers, f"{script}: no line contains {text!r}"
        marks.add((rule, numbers[0]))
    return marks


def measure() -> dict[str, float]:
    """Recall over the marked CUDA-isms and false positives per 1,000 lines, over all scripts.
    A mark counts as found when the audit reports its rule on its line."""
    marked = found = false_positives = lines = 0
    for script in HELDOUT_MARKS:
        cuda, other = _marks(script, "cuda"), _marks(script, "other")
        reported = _found(HELDOUT / script)
        marked += len(cuda)
        found += len(cuda & reported)
        false_positives += len(reported - cuda - other)
        lines += len((HELDOUT / script).read_text().splitlines())
    return {
        "marked": marked,
        "recall": found / marked,
        "false_positives": false_positives,
        "lines": lines,
        "fp_per_kloc": 1000 * false_positives / lines,
    }


@pytest.mark.parametrize("script", sorted(HELDOUT_MARKS))
def test_heldout_findings_are_the_marks(script: str) -> None:
    expected = (_marks(script, "cuda") - _marks(script, "missed")) | _marks(script, "other")
    assert _found(HELDOUT / script) == expected


def test_heldout_recall_and_precision_meet_the_targets() -> None:
    figures = measure()
    assert sorted(p.name for p in HELDOUT.glob("*.py")) == sorted(HELDOUT_MARKS)
    assert figures["marked"] >= 60 and figures["lines"] >= 1000  # a set worth measuring on
    assert figures["recall"] >= 0.95, figures
    assert figures["fp_per_kloc"] <= 1.0, figures


# -- code the rules had never seen --------------------------------------------------------------------
# Real training code from two PyPI packages (tests/fixtures/audit/unseen/, files unmodified below an
# attribution header), marked by hand before the audit was run on it (issue 40). Marks use the text of
# every line containing it. open_clip_train's first audit found 13 of 17 with
# one false positive; the two fixes that followed (a "cuda" default of a device parameter or
# getattr/add_argument, and `torch.cuda.is_available()` inside a CUDA-only branch) were made on it.
# denoising_diffusion_pytorch was marked and audited after those: 6 of 8, no false positive; an f-string
# einsum spec was read as text afterwards (7 of 8). The remaining misses are marked `missed`.
UNSEEN = FIXTURES / "unseen"
UNSEEN_MARKS: dict[str, dict[str, list[tuple[str, str]]]] = {
    "open_clip_train/main.py": {  # open_clip_torch 3.3.0
        "cuda": [
            ("cuda-device-branch", "    if torch.cuda.is_available():"),
            ("cuda-backend-flag", "torch.backends.cuda.matmul.allow_tf32 = True"),
            ("cuda-backend-flag", "torch.backends.cudnn.benchmark = True"),
            ("cuda-backend-flag", "torch.backends.cudnn.deterministic = False"),
            ("cuda-library", "import bitsandbytes as bnb"),
            ("sync-batchnorm", "torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)"),
            ("ddp-device-ids", "DistributedDataParallel(model, device_ids=[device]"),
            ("ddp-device-ids", "DistributedDataParallel(dist_model, device_ids=[device]"),
            ("cuda-amp", "scaler = torch.cuda.amp.GradScaler()"),
        ],
    },
    "open_clip_train/distributed.py": {
        "cuda": [
            ("cuda-device-string", "device=getattr(args, 'device', 'cuda')"),
            ("cuda-device-string", "device: str = 'cuda'"),
        ],
    },
    "open_clip_train/precision.py": {
        "cuda": [("cuda-device-string", "def get_autocast(precision, device_type='cuda')")],
    },
    "open_clip_train/train.py": {
        "cuda": [
            ("eval-host-copy", "all_image_features.append(image_features.cpu())"),
            ("eval-host-copy", "all_text_features.append(text_features.cpu())"),
        ],
    },
    "open_clip_train/zero_shot.py": {  # accuracy() reads `.cpu().numpy()` for every evaluation batch
        "cuda": [("host-sync", "return [float(correct[:k]")],
        "missed": [("host-sync", "return [float(correct[:k]")],
    },
    "open_clip_train/data.py": {"cuda": [("pin-memory-cuda", "pin_memory=True")]},  # two loaders
    "denoising_diffusion_pytorch/denoising_diffusion_pytorch.py": {  # denoising_diffusion_pytorch 2.3.4
        "cuda": [
            ("host-sync", "_, assign = linear_sum_assignment(dist.cpu())"),  # every step, inside the model
            ("cuda-device-string", "@autocast('cuda', enabled = False)"),
            ("pin-memory-cuda", "pin_memory = True"),
            ("host-sync", "total_loss += loss.item()"),
        ],
        "missed": [("host-sync", "_, assign = linear_sum_assignment(dist.cpu())")],
    },
    "denoising_diffusion_pytorch/fid_evaluation.py": {"cuda": [("cuda-device-string", 'device="cuda",')]},
    "denoising_diffusion_pytorch/attend.py": {
        "cuda": [
            ("cuda-device-branch", "if not torch.cuda.is_available() or not flash:"),
            ("sdpa-backend-pin", "with torch.nn.attention.sdpa_kernel(**config._asdict()):"),
            ("manual-attention", "attn = sim.softmax(dim = -1)"),
        ],
    },
}


def _unseen_marks(name: str, kind: str) -> set[tuple[str, int]]:
    lines = (UNSEEN / name).read_text().splitlines()
    marks = set()
    for rule, text in UNSEEN_MARKS[name].get(kind, []):
        numbers = [i for i, line in enumerate(lines, 1) if text in line]
        assert numbers, f"{name}: no line contains {text!r}"
        marks |= {(rule, n) for n in numbers}
    return marks


def measure_unseen() -> dict[str, dict[str, int]]:
    """Per file: marked CUDA-isms, how many the audit found, its false positives, and lines. Each
    package's folder is audited as one project, as `portatrain audit <folder>` would."""
    reported: dict[str, set[tuple[str, int]]] = {}
    for package in sorted(p for p in UNSEEN.iterdir() if p.is_dir()):
        for finding in audit_paths([package]).findings:
            name = f"{package.name}/{Path(finding.path).name}"  # no package nests folders
            reported.setdefault(name, set()).add((finding.rule, finding.line))
    figures = {}
    for name in UNSEEN_MARKS:
        marks = _unseen_marks(name, "cuda")
        found = reported.get(name, set())
        figures[name] = {
            "marked": len(marks),
            "found": len(marks & found),
            "false_positives": len(found - marks),
            "lines": len((UNSEEN / name).read_text().splitlines()),
        }
    return figures


@pytest.mark.parametrize("name", sorted(UNSEEN_MARKS))
def test_unseen_findings_are_the_marks(name: str) -> None:
    package = UNSEEN / name.split("/")[0]
    found = {
        (f.rule, f.line) for f in audit_paths([package]).findings if Path(f.path).name == Path(name).name
    }
    assert found == _unseen_marks(name, "cuda") - _unseen_marks(name, "missed")


def test_unseen_recall_and_precision_meet_the_targets() -> None:
    figures = measure_unseen()
    on_disk = {p.relative_to(UNSEEN).as_posix() for p in UNSEEN.rglob("*.py")}
    assert on_disk == set(UNSEEN_MARKS)  # every fixture file is marked, even with no CUDA-ism
    marked = sum(f["marked"] for f in figures.values())
    found = sum(f["found"] for f in figures.values())
    false_positives = sum(f["false_positives"] for f in figures.values())
    lines = sum(f["lines"] for f in figures.values())
    assert marked >= 25 and lines >= 3000, (marked, lines)
    assert found / marked >= 0.9, figures
    assert 1000 * false_positives / lines <= 1.0, figures
