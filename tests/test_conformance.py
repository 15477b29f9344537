"""Conformance: every model family in the registry (``portatrain.models.SPECS``) passes the same checks.

A family added to the registry is tested here without editing this file: everything below reaches
it through its :class:`~portatrain.models.spec.ModelSpec` and the model/arguments contract written in
``portatrain/models/spec.py``, and the Trainer reaches it through ``model.name``. Per family:

* the model builds on the meta device; ``to_empty`` + ``init_weights`` fills every tensor (finite,
  deterministic under the seed, buffers equal to a model built on CPU);
* the analytic parameter count (``args.num_params()``) equals the built model's, for the debug
  flavour and, on meta, for every published flavour, where it also equals ``spec.published_params``;
* every flavour's HF ``config.json`` builds in ``transformers`` and reads back to the same model;
* the generic forward contract: causal by default, packed documents (restarting positions plus a
  block-diagonal mask) equal separate runs, backward reaches every parameter;
* fp32 logits parity with the family's ``transformers`` class (``spec.hf.architecture``) at random
  weights, both ways (ours -> HF keys, HF -> ours), within 1e-4, untied and tied, with two kv-head layouts;
* kernel slots (``rmsnorm_fn``, ``swiglu_fn``, ``rope_fn``): every one used in the forward, no RMSNorm
  or SiLU computed outside them, and the ``pallas_interpret_*`` overrides matching the references;
* two Trainer steps, eager and with ``torch.compile`` per block, agreeing; then ``export`` ->
  ``transformers.from_pretrained`` with matching logits and ``model.init_from`` back bit-identical;
* bf16, both as the Trainer runs it without FSDP2 (autocast over fp32 weights) and with it (FSDP2's
  ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``, here on a one-process gloo group):
  forward, backward and one AdamW step, each mixture-of-experts dispatch, within the tolerance derived
  in ``tests/helpers.py`` of the fp32 run;
* FSDP2 on two processes (one ``torchrun`` launch for every family) equal to one process (slow);
* the dry run's memory estimate (``spec.estimate_memory``) within 15% of the measured CPU peak;
* a layout the family refuses (``spec.parallel_problems``) is one error, exit 2, in a dry run.

Family-specific behaviour (Llama 3.1 RoPE scaling, Qwen 3's q/k norms, published HF configs, TP
plans) stays in the family's own test files.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from portatrain.checkpoint import complete_checkpoints
from portatrain.export import export_hf
from portatrain.kernels import OPERATIONS, apply, reference, resolve
from portatrain.models import SPECS, model_args
from portatrain.plan import estimate_for_config
from portatrain.profiling import measured_peak_bytes
from portatrain.trainer import Trainer
from tests import shared_launch
from tests.helpers import (
    TINY,
    bf16_tolerance,
    compose_config,
    decoder_roundings,
    fit,
    make_trainer,
    relative_error,
    run_cli,
    train_records,
)

FAMILIES = sorted(SPECS)
PUBLISHED = [(name, flavor) for name in FAMILIES for flavor in sorted(SPECS[name].published_params)]
ATOL = 1e-4
"""Largest absolute logits difference allowed against ``transformers`` in fp32."""

STEPS = 2
TRAIN = [f"trainer.steps={STEPS}", "optim.warmup_steps=1", "model.flavor=debug", "model.n_layers=2"]
"""The Trainer runs: the debug flavour cut to two blocks, two steps, batch 4 x 64 tokens (TINY)."""


def small_args(spec):
    """The debug flavour with two blocks: every code path of the family, at the least cost."""
    return dataclasses.replace(spec.flavors["debug"], n_layers=2)


def family_overrides(name: str) -> list[str]:
    return [f"model.name={name}", *TRAIN]


@pytest.fixture(scope="module", params=FAMILIES)
def family(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="module")
def spec(family: str):
    return SPECS[family]


def _tokens(vocab_size: int, batch: int = 2, seq_len: int = 24, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab_size, (batch, seq_len), generator=torch.Generator().manual_seed(seed))


def _positions(seq_len: int = 24) -> torch.Tensor:
    """Row 0 far from position 0, row 1 near it: RoPE at positions the default ``arange`` never uses."""
    return torch.stack([torch.arange(seq_len) + 60, torch.arange(seq_len) + 3])


def _built(spec, args, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    model = spec.model_cls(args)
    model.init_weights()
    return model.eval()


# ---------------------------------------------------------------------------------------------
# Construction and parameter counts
# ---------------------------------------------------------------------------------------------


def _meta_init(spec, args, seed: int) -> nn.Module:
    with torch.device("meta"):
        model = spec.model_cls(args)
    assert all(t.is_meta for t in [*model.parameters(), *model.buffers()])
    model.to_empty(device="cpu")
    # to_empty leaves whatever was in memory; poison it so an uninitialized tensor cannot hide.
    with torch.no_grad():
        for t in [*model.parameters(), *model.buffers()]:
            t.fill_(float("nan"))
    torch.manual_seed(seed)
    model.init_weights(std=0.02)
    return model.eval()


def test_meta_build_then_init_is_finite_deterministic_and_equals_a_cpu_build(spec) -> None:
    args = small_args(spec)
    a, b, c = _meta_init(spec, args, seed=5), _meta_init(spec, args, seed=5), _meta_init(spec, args, seed=6)
    assert a.args == args and isinstance(a.layers, nn.ModuleDict) and len(a.layers) == args.n_layers
    for name, t in [*a.named_parameters(), *a.named_buffers()]:
        assert torch.isfinite(t).all(), name
    for (name, ta), tb in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        assert torch.equal(ta, tb), name
    assert not torch.equal(a.embed_tokens.weight, c.embed_tokens.weight)  # the seed is used
    cpu = spec.model_cls(args)  # buffers derived from the arguments (RoPE tables) rebuilt alike
    for (name, ta), tb in zip(a.named_buffers(), cpu.buffers(), strict=True):
        assert torch.equal(ta, tb), name
    assert a.state_dict().keys() == cpu.state_dict().keys()
    x = _tokens(args.vocab_size)
    logits = a(x)
    assert logits.shape == (*x.shape, args.vocab_size) and logits.dtype == torch.float32
    torch.testing.assert_close(logits, b(x), atol=0, rtol=0)


def test_analytic_parameter_count_equals_the_built_models(spec) -> None:
    args = spec.flavors["debug"]
    with torch.device("meta"):
        model = spec.model_cls(args)
    counted = sum(p.numel() for p in model.parameters())  # a tied matrix once
    assert args.num_params() == model.num_params() == counted


def test_every_published_flavour_has_a_published_count(spec) -> None:
    assert set(spec.published_params) == set(spec.flavors) - {"debug"}


@pytest.mark.parametrize(("name", "flavor"), PUBLISHED, ids=[f"{n}-{f}" for n, f in PUBLISHED])
def test_published_flavour_parameter_count_on_meta(name: str, flavor: str) -> None:
    spec = SPECS[name]
    args = spec.flavors[flavor]
    with torch.device("meta"):
        model = spec.model_cls(args)
    assert model.num_params() == args.num_params() == spec.published_params[flavor]


def _hf_class(spec):
    transformers = pytest.importorskip("transformers")
    return getattr(transformers, spec.hf.architecture)


def test_every_flavours_hf_config_builds_in_transformers_and_reads_back(spec) -> None:
    config_class = _hf_class(spec).config_class
    for flavor, args in spec.flavors.items():
        config = spec.hf.config(args, torch_dtype="float32")
        # A copy: transformers may edit the nested dicts it is given (rope_scaling -> rope_parameters).
        back = spec.hf.args_from_config(config_class(**copy.deepcopy(config)).to_dict())
        # The same model, possibly spelled differently (e.g. a derived width stored explicitly).
        assert spec.hf.config(back, torch_dtype="float32") == config, flavor
        assert back.num_params() == args.num_params(), flavor


# ---------------------------------------------------------------------------------------------
# The forward contract every family keeps
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model(spec) -> nn.Module:
    """The two-block debug model, initialized (shared by the read-only checks)."""
    return _built(spec, small_args(spec))


def test_default_causal_mask_and_causality(model) -> None:
    x = _tokens(model.args.vocab_size, seq_len=16)
    with torch.no_grad():
        logits = model(x)
        mask = torch.ones(16, 16, dtype=torch.bool).tril().expand(2, 1, 16, 16)
        torch.testing.assert_close(logits, model(x, attn_mask=mask), atol=1e-5, rtol=0)
        y = x.clone()
        y[:, 10:] = (y[:, 10:] + 1) % model.args.vocab_size
        changed = model(y)
    torch.testing.assert_close(changed[:, :10], logits[:, :10], atol=1e-5, rtol=0)
    assert not torch.allclose(changed[:, 10:], logits[:, 10:], atol=1e-4)  # the change is seen


def test_packed_documents_equal_separate_runs(model) -> None:
    """Restarting positions plus a block-diagonal causal mask -- what the packing collator relies on."""
    vocab = model.args.vocab_size
    doc_a, doc_b = _tokens(vocab, 1, 10, seed=2), _tokens(vocab, 1, 7, seed=3)
    packed = torch.cat([doc_a, doc_b], dim=1)
    positions = torch.cat([torch.arange(10), torch.arange(7)]).unsqueeze(0)
    doc_id = torch.tensor([0] * 10 + [1] * 7)
    mask = (doc_id[:, None] == doc_id[None, :]) & torch.ones(17, 17, dtype=torch.bool).tril()
    with torch.no_grad():
        logits = model(packed, positions=positions, attn_mask=mask.expand(1, 1, 17, 17))
        torch.testing.assert_close(logits[:, :10], model(doc_a), atol=1e-5, rtol=0)
        torch.testing.assert_close(logits[:, 10:], model(doc_b), atol=1e-5, rtol=0)


def test_backward_reaches_every_parameter(spec) -> None:
    model = _built(spec, small_args(spec)).train()
    x = _tokens(model.args.vocab_size, seq_len=12)
    F.cross_entropy(model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten()).backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name


# ---------------------------------------------------------------------------------------------
# Logits parity with the family's transformers class
# ---------------------------------------------------------------------------------------------

VARIANTS = ["debug", "tie-flipped", "other-kv-heads"]
"""The debug flavour (two blocks); the same with ``tie_embeddings`` flipped; the same with one kv head
per query head (MHA), or with one kv head for all if the debug flavour is MHA already."""


def _variant(spec, variant: str):
    args = small_args(spec)
    if variant == "tie-flipped":
        return dataclasses.replace(args, tie_embeddings=not args.tie_embeddings)
    if variant == "other-kv-heads":
        other = dataclasses.replace(args, n_kv_heads=args.n_heads if args.n_kv_heads != args.n_heads else 1)
        refused = other.problems()
        if refused:  # e.g. latent attention: a key and a value per head, always
            pytest.skip(f"{spec.name} has one kv-head layout only: {refused[0]}")
        return other
    return args


def _attn_implementation(cls) -> str:
    """SDPA where the class offers it, else its eager attention (GPT-OSS: SDPA has no sinks)."""
    return "sdpa" if cls._supports_sdpa else "eager"


def _hf_model(spec, args) -> nn.Module:
    cls = _hf_class(spec)
    config = cls.config_class(
        **spec.hf.config(args, torch_dtype="float32"), attn_implementation=_attn_implementation(cls)
    )
    return cls(config).eval()


def randomize_(model: nn.Module, seed: int) -> None:
    """Fill every parameter with noise, norm gains around 1, so no weight is left at its init."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1 + 0.2 * noise if "norm" in name else 0.05 * noise)


def _max_logits_error(ours: nn.Module, theirs: nn.Module, positions: torch.Tensor | None) -> float:
    tokens = _tokens(ours.args.vocab_size)
    with torch.no_grad():
        expected = theirs(input_ids=tokens, position_ids=positions).logits
        return (ours(tokens, positions=positions) - expected).abs().max().item()


# Weights cross over as files, the way checkpoints do: transformers' own loading and saving may
# convert between its checkpoint layout and its modules' (e.g. per-expert matrices <-> one fused
# tensor in transformers 5), which a state dict loaded into the module directly would bypass.


@pytest.mark.parametrize("variant", VARIANTS)
def test_ours_to_hf_logits_match(spec, variant: str, tmp_path: Path) -> None:
    from safetensors.torch import save_file

    args = _variant(spec, variant)
    ours = spec.model_cls(args).eval()
    randomize_(ours, seed=1)
    (tmp_path / "config.json").write_text(json.dumps(spec.hf.config(args, torch_dtype="float32")))
    save_file(
        {k: v.contiguous() for k, v in spec.hf.to_hf(ours.state_dict()).items()},
        str(tmp_path / "model.safetensors"),
    )
    cls = _hf_class(spec)
    theirs, info = cls.from_pretrained(
        tmp_path, dtype=torch.float32, attn_implementation=_attn_implementation(cls), output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"], info  # a tied head is tied, not missing
    if args.tie_embeddings:
        assert theirs.get_output_embeddings().weight is theirs.get_input_embeddings().weight
    for positions in (None, _positions()):
        error = _max_logits_error(ours, theirs.eval(), positions)
        assert error <= ATOL, f"positions={positions is not None}: {error:.2e}"


@pytest.mark.parametrize("variant", VARIANTS)
def test_hf_to_ours_logits_match_and_the_mapping_round_trips(spec, variant: str, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    args = _variant(spec, variant)
    torch.manual_seed(2)
    theirs = _hf_model(spec, args)
    randomize_(theirs, seed=2)
    read = spec.hf.args_from_config(theirs.config.to_dict())
    assert spec.hf.config(read, torch_dtype="float32") == spec.hf.config(args, torch_dtype="float32")
    theirs.save_pretrained(tmp_path)
    hf_state = {k: v for f in sorted(tmp_path.glob("*.safetensors")) for k, v in load_file(str(f)).items()}
    ours = spec.model_cls(args).eval()
    ours.load_state_dict(spec.hf.from_hf(hf_state, tie_embeddings=args.tie_embeddings), strict=True)
    error = _max_logits_error(ours, theirs, _positions())
    assert error <= ATOL, f"{error:.2e}"
    state = ours.state_dict()
    back = spec.hf.from_hf(spec.hf.to_hf(state), tie_embeddings=args.tie_embeddings)
    assert back.keys() == state.keys()
    for key, value in back.items():
        assert torch.equal(value, state[key]), key


# ---------------------------------------------------------------------------------------------
# Kernel slots
# ---------------------------------------------------------------------------------------------


class _OutsideSlots(TorchFunctionMode):
    """Counts RMSNorm and SiLU computed while no kernel slot is running (i.e. bypassing the slots)."""

    def __init__(self) -> None:
        super().__init__()
        self.inside = 0
        self.bypassed: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if self.inside == 0 and func in (F.rms_norm, F.silu, torch.rms_norm):
            self.bypassed.append(func.__name__)
        return func(*args, **(kwargs or {}))


def test_every_norm_feed_forward_and_attention_goes_through_a_kernel_slot(model) -> None:
    model = copy.deepcopy(model)
    mode = _OutsideSlots()
    calls: dict[tuple[str, str], int] = {}

    def counting(op: str, where: str):
        fn = getattr(reference, op)
        calls[(op, where)] = 0

        def slot(*args):
            calls[(op, where)] += 1
            mode.inside += 1
            try:
                return fn(*args)
            finally:
                mode.inside -= 1

        return slot

    for where, module in model.named_modules():
        for op, operation in OPERATIONS.items():
            if hasattr(module, operation.slot):
                assert getattr(module, operation.slot) is getattr(reference, op), (where, op)
                setattr(module, operation.slot, counting(op, where))
    slots = {op: sorted(w for o, w in calls if o == op) for op in OPERATIONS}
    n_layers = len(model.layers)
    # At least: two norms per block and the final one, one attention per block. A feed-forward holds
    # the swiglu slot where its gate is SiLU; another gate (Gemma's GELU-tanh, GPT-OSS's clamped
    # sigmoid) has no kernel and no slot, and the bypass check below catches a SiLU outside a slot.
    assert len(slots["rmsnorm"]) >= 2 * n_layers + 1, slots["rmsnorm"]
    assert len(slots["rope"]) >= n_layers, slots
    # Modules that look like a norm (a gain and an epsilon) hold the rmsnorm slot.
    norms = sorted(w for w, m in model.named_modules() if hasattr(m, "eps") and hasattr(m, "weight"))
    assert norms == slots["rmsnorm"]
    with mode, torch.no_grad():
        model(_tokens(model.args.vocab_size, seq_len=8))
    assert mode.bypassed == [], f"computed outside the kernel slots: {mode.bypassed}"
    unused = [key for key, n in calls.items() if n == 0]
    assert unused == [], f"slots never called: {unused}"
    assert all(n == 2 for (op, _), n in calls.items() if op == "rope")  # queries and keys


def test_pallas_interpret_overrides_match_the_references(model) -> None:
    pytest.importorskip("jax", reason="jax is not installed (pip install 'portatrain[pallas]')")
    kernels = copy.deepcopy(model).train()
    # The overrides of the operations the model has slots for (no swiglu slot without a SiLU gate).
    ops = [op for op in OPERATIONS if any(hasattr(m, OPERATIONS[op].slot) for m in model.modules())]
    counts = apply(kernels, resolve([f"pallas_interpret_{op}" for op in ops], "cpu"))
    assert all(n > 0 for n in counts.values()), counts
    ref = copy.deepcopy(model).train()
    tokens, positions = _tokens(model.args.vocab_size, seq_len=16), _positions(16)
    results = []
    for m in (ref, kernels):
        loss = F.cross_entropy(
            m(tokens[:, :-1], positions=positions[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten()
        )
        loss.backward()
        results.append((loss, {k: p.grad for k, p in m.named_parameters()}))
    (ref_loss, ref_grads), (loss, grads) = results
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[name], rtol=1e-4, atol=1e-6, msg=name)
    # The overrides really replaced the references (a KernelSet that changed nothing would pass).
    assert not any(
        getattr(m, OPERATIONS[op].slot, None) is getattr(reference, op)
        for m in kernels.modules()
        for op in ops
    )


# ---------------------------------------------------------------------------------------------
# bf16: autocast over fp32 weights, and FSDP2's bf16 policy, against fp32
# ---------------------------------------------------------------------------------------------

BF16_MODES = ("autocast", "fsdp2_policy")
"""How the Trainer computes in bf16: autocast over fp32 weights (one process), and -- where FSDP2
shards -- its ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`` under the same autocast."""


@pytest.fixture
def one_rank_mesh():
    """A one-process gloo group and its mesh: FSDP2 over one rank casts parameters and reduces
    gradients exactly as over many (its all-gather and reduce-scatter are copies here)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def _train_step(spec, mode: str, dispatch: str, mesh, tokens: torch.Tensor) -> dict:
    """One forward, backward and AdamW step of the two-block debug model, then a second forward:
    the logits and loss before the step, every gradient, the loss after it."""
    from portatrain.accelerators.cpu import CPUAccelerator
    from portatrain.models.common.moe import configure_moe
    from portatrain.models.common.parallelize import apply_fsdp

    with torch.device("meta"):
        model = spec.model_cls(small_args(spec))
    supports = CPUAccelerator().supports_grouped_mm
    configure_moe(
        model, dispatch=dispatch, capacity_factor=1.25, aux_loss_scale=1.0, supports_grouped_mm=supports
    )
    if mode == "fsdp2_policy":
        apply_fsdp(model, mesh, param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    with torch.no_grad():
        model.init_weights()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    bf16 = torch.autocast("cpu", dtype=torch.bfloat16) if mode != "fp32" else contextlib.nullcontext()

    def loss_of(logits: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())

    with bf16:
        logits = model(tokens[:, :-1])
    loss = loss_of(logits)
    loss.backward()
    grads = {
        name: p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        for name, p in model.named_parameters()
    }
    masters = {name: p.dtype for name, p in model.named_parameters()}
    optimizer.step()
    with torch.no_grad(), bf16:
        after = loss_of(model(tokens[:, :-1]))
    return {
        "logits": logits.detach(),
        "loss": loss.item(),
        "grads": grads,
        "masters": masters,
        "after": after.item(),
    }


def test_bf16_autocast_and_fsdp2_policy_match_fp32_within_the_derived_tolerance(spec, one_rank_mesh) -> None:
    """Tolerances (``tests/helpers.py``): two blocks make 20 roundings on the forward's deepest path,
    so logits within 3 * sqrt(20) * 2**-8 = 5.2e-2 of fp32 (relative, over all of them), gradients
    (60 roundings) within 9.1e-2; the loss, a mean of cross-entropies, moves by at most twice the
    largest logit change, held to the logits' bound too. After the AdamW step (fp32 master weights
    and state in every mode) the loss is held to the same bound: Adam's first update is
    ``lr * sign(g)``, so the runs' updates differ only where rounding flips a gradient's sign, i.e.
    where the gradient is within rounding of zero and moves the loss by next to nothing. Measured on
    an AVX2 CPU (every family, mode and dispatch): logits 3.5e-3 to 2.0e-2, gradients 4.4e-3 to
    3.4e-2 (DeepSeek-V3 under the FSDP2 policy the largest), losses 2e-6 to 2.8e-4."""
    args = small_args(spec)
    forward = bf16_tolerance(decoder_roundings(args.n_layers))
    backward = bf16_tolerance(decoder_roundings(args.n_layers, backward=True))
    tokens = _tokens(args.vocab_size, batch=2, seq_len=33)
    sparse = any(args.is_sparse(layer) for layer in range(args.n_layers))
    for dispatch in ("capacity", "dropless") if sparse else ("dropless",):
        want = _train_step(spec, "fp32", dispatch, one_rank_mesh, tokens)
        for mode in BF16_MODES:
            case = f"{mode}, {dispatch}"
            got = _train_step(spec, mode, dispatch, one_rank_mesh, tokens)
            assert got["logits"].dtype == torch.bfloat16, case  # computed in bf16, not upcast
            assert set(got["masters"].values()) == {torch.float32}, case  # fp32 master weights
            error = relative_error(got["logits"], want["logits"])
            assert 0 < error <= forward, f"{case}: logits {error:.2e} > {forward:.2e}"
            for key in ("loss", "after"):
                assert got[key] == pytest.approx(want[key], rel=forward), (case, key)
            for name, grad in got["grads"].items():
                assert grad.dtype == torch.float32 and torch.isfinite(grad).all(), (case, name)
            error = relative_error(list(got["grads"].values()), list(want["grads"].values()))
            assert error <= backward, f"{case}: gradients {error:.2e} > {backward:.2e}"


# ---------------------------------------------------------------------------------------------
# Through the Trainer: training eager and compiled, export, init_from
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def trained(family: str, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Trainer]:
    """Two eager steps of the two-block debug model (checkpoint at the end): its directory and trainer."""
    run_dir = tmp_path_factory.mktemp(f"{family}-eager") / "run"
    return run_dir, fit(family_overrides(family), run_dir)


def test_two_steps_eager_and_compiled_per_block_agree(family: str, trained, tmp_path: Path) -> None:
    run_dir, trainer = trained
    assert type(trainer.model) is SPECS[family].model_cls
    eager = train_records(run_dir)
    assert [r["step"] for r in eager] == list(range(1, STEPS + 1))
    assert all(torch.isfinite(torch.tensor([r["loss"], r["grad_norm"]])).all() for r in eager)
    # aot_eager traces forward and backward as inductor would, without generating code.
    torch._dynamo.reset()
    try:
        compiled_trainer = fit(
            [
                *family_overrides(family),
                "compile.enabled=true",
                "compile.backend=aot_eager",
                "checkpoint.enabled=false",
            ],
            tmp_path / "compiled",
        )
    finally:
        torch._dynamo.reset()
    assert all(block._compiled_call_impl is not None for block in compiled_trainer.model.layers.values())
    compiled = train_records(tmp_path / "compiled")
    assert [r["loss"] for r in compiled] == pytest.approx([r["loss"] for r in eager], abs=1e-5)
    assert [r["grad_norm"] for r in compiled] == pytest.approx([r["grad_norm"] for r in eager], rel=1e-4)


@pytest.fixture(scope="module")
def exported(trained, tmp_path_factory: pytest.TempPathFactory) -> Path:
    run_dir, _ = trained
    checkpoint = complete_checkpoints(run_dir / "checkpoints")[-1]
    return export_hf(checkpoint, tmp_path_factory.mktemp("hf") / "hf", max_shard_size=300_000)


def test_export_loads_in_transformers_with_matching_logits(spec, trained, exported: Path) -> None:
    _, trainer = trained
    args = trainer.model.args
    config = json.loads((exported / "config.json").read_text())
    assert config["architectures"] == [spec.hf.architecture]
    assert config["tie_word_embeddings"] is args.tie_embeddings
    theirs = _hf_class(spec).from_pretrained(exported, dtype=torch.float32).eval()
    for positions in (None, _positions()):
        error = _max_logits_error(trainer.model.eval(), theirs, positions)
        assert error <= ATOL, f"positions={positions is not None}: {error:.2e}"


def test_init_from_the_export_is_bit_identical(family: str, trained, exported: Path, tmp_path: Path) -> None:
    _, trainer = trained
    cfg = compose_config(
        [*TINY, *family_overrides(family), f"model.init_from={exported}"], run_dir=tmp_path / "run"
    )
    started = Trainer(cfg)
    try:
        source = trainer.model.state_dict()
        loaded = started.model.state_dict()
        assert loaded.keys() == source.keys()
        for key, value in loaded.items():
            assert torch.equal(value, source[key]), key  # fp32 export: bit-exact
    finally:
        started.close()
    fresh = _built(SPECS[family], trainer.model.args, seed=0)
    assert not all(torch.equal(v, source[k]) for k, v in fresh.state_dict().items())  # not by the seed


# ---------------------------------------------------------------------------------------------
# FSDP2 on two processes, against the one-process run above
# ---------------------------------------------------------------------------------------------


# Every family with parallel.dp_shard=2 in the session's two-process launch (tests/shared_launch.py),
# per rank 2 rows: the same global batch of 4 as the one-process run.
NO_SAVE = ["checkpoint.enabled=false"]
fsdp2_runs = shared_launch.declare(
    "fsdp2_runs",
    2,
    {
        family: [*TINY, *family_overrides(family), "parallel.dp_shard=2", "data.batch_size=2", *NO_SAVE]
        for family in FAMILIES
    },
)


@pytest.mark.slow
def test_fsdp2_on_two_processes_matches_one(family: str, trained, fsdp2_runs: dict[str, Path]) -> None:
    run_dir, _ = trained
    records, reference = train_records(fsdp2_runs[family]), train_records(run_dir)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    for got, want in zip(records, reference):
        assert got["loss"] == pytest.approx(want["loss"], abs=1e-5), (got, want)
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-5), (got, want)


# ---------------------------------------------------------------------------------------------
# Memory estimate against the measured CPU peak
# ---------------------------------------------------------------------------------------------

MEMORY_RUN = [
    # Wider than the debug flavour: at dim 128 and a 258-token vocabulary the estimate's per-token
    # terms are too small for a 15% bound to say much about the model's part.
    "model.dim=256",
    "model.n_heads=4",
    "model.n_kv_heads=2",
    "model.vocab_size=8192",
    "data.batch_size=4",
    "data.seq_len=256",
    "data.collator=pad_to_max",
    "trainer.dtype=float32",
]
MEMORY_MODES = {
    # The estimate's two newest terms: recomputation after the head's buffers are freed; one chunk of logits.
    "full-checkpointing": ["parallel.activation_checkpointing=full"],
    "chunked-loss": ["trainer.loss=chunked", "trainer.loss_chunk_size=256"],
}


def _held_bytes(trainer: Trainer) -> int:
    tensors = {id(p): p for p in trainer.model.parameters()}
    for state in trainer.optimizer.state.values():
        tensors.update({id(t): t for t in state.values() if isinstance(t, torch.Tensor) and t.numel() > 1})
    return sum(t.numel() * t.element_size() for t in tensors.values())


@pytest.mark.parametrize("mode", sorted(MEMORY_MODES))
def test_memory_estimate_within_15_percent_of_the_measured_peak(
    family: str, mode: str, tmp_path: Path
) -> None:
    """A Trainer on CPU in fp32 takes a step (AdamW's moments now exist), then a second under torch's
    CPU-allocator accounting (``measured_peak_bytes``). Measured peak = parameters + optimizer state
    held before the step + the step's peak above it, against ``estimate_for_config`` (what
    ``dry_run=true`` prints). ``scripts/bench_memory.py`` measures more configurations."""
    run = MEMORY_RUN
    if dataclasses.replace(SPECS[family].flavors["debug"], n_heads=4, n_kv_heads=2).problems():
        run = [o for o in run if not o.startswith("model.n_kv_heads=")]  # no grouped-query layout
    trainer = make_trainer([*family_overrides(family), *run, *MEMORY_MODES[mode]], tmp_path)
    try:
        loader = iter(trainer.train_loader)
        trainer.train_step([next(loader)])
        batch = next(loader)
        held = _held_bytes(trainer)
        measured = held + measured_peak_bytes(lambda: trainer.train_step([batch]))
        estimate = estimate_for_config(trainer.cfg, world_size=1)
    finally:
        trainer.close()
    assert estimate["params"] + estimate["optimizer"] == held  # the persistent state is exact
    ratio = estimate["total"] / measured
    assert 0.85 <= ratio <= 1.15, f"estimate {estimate['total']:,} B vs measured {measured:,} B ({ratio:.3f})"


# ---------------------------------------------------------------------------------------------
# A layout the family refuses is one error before any process starts
# ---------------------------------------------------------------------------------------------

LAYOUTS = [["parallel.tp=2"], ["parallel.tp=4"], ["parallel.dp_shard=2", "parallel.tp=2"], ["parallel.cp=2"]]
"""Layouts tried, in order, for one the family refuses (the debug flavour: 4 heads, 2 kv heads)."""


def test_a_refused_layout_is_one_error_in_a_dry_run(family: str, tmp_path: Path) -> None:
    spec = SPECS[family]
    base = ["device=cpu", "dry_run=true", f"model.name={family}", "model.flavor=debug"]
    for layout in LAYOUTS:
        cfg = compose_config([*base, *layout])
        problems = spec.parallel_problems(cfg.parallel, model_args(cfg.model))
        if problems:
            break
    else:
        pytest.skip(f"{family} refuses none of {LAYOUTS}")
    # A fresh process: in this one, after the Pallas check above imported JAX under pytest's output
    # capture, the CLI's error path ended in "I/O operation on closed file".
    out = run_cli([*base, *layout], cwd=tmp_path)
    assert out.returncode == 2, f"{layout}: exit {out.returncode}\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}"
    # One error, no traceback, listing the family's problems and nothing else.
    assert out.stderr.startswith("portatrain train: error:") and "Traceback" not in out.stderr, out.stderr
    assert all(problem in out.stderr for problem in problems), (out.stderr, problems)
    assert out.stderr.count("\n  - ") == len(problems), out.stderr
