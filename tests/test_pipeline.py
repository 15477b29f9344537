"""Pipeline parallelism (``parallel.pp``, ``portatrain.parallel.pipeline``).

* The split: blocks per stage (even, extra blocks to the middle stages, or ``parallel.pp_layers``), the
  stages of a rank (loop or V), the parts cut from a meta model (embedding first, norm and head last,
  unsplit names), and the initialization of the parts equal to the whole model's.
* Bad input, refused by validation with one line each and exit 2, before any process group starts.
* Under ``torchrun`` (slow tier), in the session's launch of each world size (``tests/shared_launch.py``): every schedule
  on 2 processes, pp2 x dp2 and pp2 x tp2 on 4 (with activation checkpointing and compiled blocks),
  pp2 x dp2 x tp2 on 8, each equal to one process on the same global batch within 1e-5 (and 1F1B in
  bf16 against one process in bf16, within the bound of ``tests/helpers.py``, and Interleaved1F1B with tied
  embeddings, the last stage holding a copy of the first's matrix); evaluation
  through the pipeline; a checkpoint saved at pp=2 on 2 processes resumes at pp=1 on one and at pp=4 on
  4, one saved at pp=1 resumes at pp=2 with two stages a rank, and ``portatrain export`` reads a
  pipelined checkpoint; pp2 x dp2 and pp2 x tp2 on ``device=sim`` equal to one process too.
* Stopping, as without a pipeline: a rank SIGKILLed inside a save leaves whole checkpoints and, restarted
  by torchrun, resumes with the clean run's losses; SIGTERM to ``portatrain torchrun`` saves and exits 0.
"""

from __future__ import annotations

import json
import random
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from portatrain.checkpoint import complete_checkpoints, inspect_checkpoint
from portatrain.launch import render_job
from portatrain.models import build_model, model_args
from portatrain.parallel.parallel_dims import layout_problems
from portatrain.parallel.pipeline import bubble_fraction, split_model, stage_ids, stage_layers
from portatrain.plan import describe_plan
from portatrain.validate import config_problems
from tests import fault_injection, shared_launch
from tests.helpers import (
    BF16,
    ROOT,
    TINY,
    bf16_tolerance,
    compose_config,
    decoder_roundings,
    fit,
    launch_env,
    launch_runs,
    read_metrics,
    run_cli,
    sigterm_portatrain_torchrun,
    step_losses,
    torchrun_command,
    train_records,
)

STEPS = 3
RUN = [*TINY, f"trainer.steps={STEPS}", "checkpoint.enabled=false"]  # 4 rows of 64 tokens a step
PP2 = ["parallel.pp=2", "parallel.pp_microbatches=2"]
TIED = "model.tie_embeddings=true"


# ---------------------------------------------------------------------------------------------
# The split
# ---------------------------------------------------------------------------------------------


def test_blocks_split_evenly_extra_ones_to_the_middle_or_as_given() -> None:
    assert stage_layers(4, 2) == [[0, 1], [2, 3]]
    assert stage_layers(7, 4) == [[0, 1], [2, 3], [4, 5], [6]]  # middle stages first, then the first
    assert stage_layers(6, 4) == [[0], [1, 2], [3, 4], [5]]
    assert stage_layers(5, 2) == [[0, 1, 2], [3, 4]]
    assert stage_layers(4, 2, [1, 3]) == [[0], [1, 2, 3]]


def test_a_rank_runs_stages_in_a_loop_or_in_a_v() -> None:
    assert stage_ids(0, 2, 1, "1F1B") == [0]
    assert stage_ids(1, 4, 2, "Interleaved1F1B") == [1, 5]
    assert stage_ids(0, 2, 2, "ZBVZeroBubble") == [0, 3]
    assert stage_ids(1, 2, 2, "ZBVZeroBubble") == [1, 2]


def test_the_bubble_is_p_minus_1_over_m_plus_p_minus_1() -> None:
    assert bubble_fraction("1F1B", 4, 4) == pytest.approx(3 / 7)
    assert bubble_fraction("GPipe", 2, 8) == pytest.approx(1 / 9)
    assert bubble_fraction("Interleaved1F1B", 4, 4, virtual=2) == pytest.approx(3 / 11)


def test_parts_keep_the_unsplit_names_and_initialize_as_the_whole_model() -> None:
    cfg = compose_config(RUN)
    with torch.device("meta"):
        whole = build_model(cfg.model, vocab_size=258)
    layers = stage_layers(whole.args.n_layers, 4, [1, 1, 1, 1])
    parts = split_model(whole, layers, [0, 1, 2, 3])
    assert parts[0].embed_tokens is not None and parts[0].norm is None and parts[0].lm_head is None
    assert parts[3].embed_tokens is None and parts[3].norm is not None and parts[3].lm_head is not None
    assert [list(p.layers) for p in parts] == [["0"], ["1"], ["2"], ["3"]]
    names = [n for p in parts for n, _ in p.named_parameters()]
    assert sorted(names) == sorted(n for n, _ in whole.named_parameters())

    def init(model: torch.nn.Module) -> dict[str, torch.Tensor]:
        model.to_empty(device="cpu")
        torch.manual_seed(7)
        model.init_weights(0.02)
        return dict(model.state_dict())

    reference = init(build_model(cfg.model, vocab_size=258))
    for part in parts:
        for name, tensor in init(part).items():
            assert torch.equal(tensor, reference[name]), name


# ---------------------------------------------------------------------------------------------
# Bad input
# ---------------------------------------------------------------------------------------------


def test_pp_must_divide_the_world_size() -> None:
    (problem,) = layout_problems(dp_replicate=1, dp_shard=-1, tp=1, world_size=6, pp=4)
    assert "pp(4) * dp_replicate(1) * tp(1) = 4 does not divide world size 6" in problem
    (problem,) = layout_problems(dp_replicate=1, dp_shard=2, tp=2, world_size=4, pp=2)
    assert "pp(2) * dp_replicate(1) * dp_shard(2) * tp(2) = 8 != world size 4" in problem
    assert "set parallel.dp_shard=1" in problem
    assert layout_problems(dp_replicate=1, dp_shard=-1, tp=2, world_size=8, pp=2) == []


def test_pp_with_cp_is_refused_naming_both() -> None:
    (problem,) = layout_problems(dp_replicate=1, dp_shard=1, tp=1, world_size=4, pp=2, cp=2)
    assert problem.startswith("parallel.pp=2 with parallel.cp=2: pipeline parallel and context parallel")
    assert "set parallel.pp=1 or parallel.cp=1" in problem


def test_bad_pipeline_settings_are_one_line_each_before_any_process_starts(tmp_path: Path) -> None:
    base = ["device=cpu", "data.batch_size=6"]
    out = run_cli(
        [
            *base,
            "dry_run=true",
            "parallel.pp=4",
            "parallel.pp_virtual_stages=2",  # 1F1B runs one stage a rank; 8 stages > 4 blocks
            "parallel.pp_microbatches=4",  # does not divide 6 rows
            "compile=enabled",
            "compile.granularity=model",
            "data.collator=bucket",
        ],
        cwd=tmp_path,
    )
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-3000:]
    for line in (
        "parallel.pp_virtual_stages=2: 1F1B runs one stage per rank",
        "the model has 4 blocks, fewer than the pp(4) * pp_virtual_stages(2) = 8 pipeline stages",
        "parallel.pp_microbatches=4 must divide data.batch_size=6",
        "compile.granularity=model with parallel.pp=4",
        "parallel.pp=4 with data.collator=bucket",
    ):
        assert line in out.stderr, (line, out.stderr[-3000:])


def test_bad_schedule_settings_and_world_size_are_config_problems(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    zbv = [
        "dry_run=true",
        "parallel.pp=2",
        "parallel.pp_schedule=ZBVZeroBubble",  # needs exactly 2 stages a rank, no compile
        "compile=enabled",
        "parallel.activation_checkpointing=selective",
        "trainer.eval_every=10",
    ]
    problems = "\n".join(config_problems(compose_config(zbv)))
    for line in (
        "parallel.pp_virtual_stages=1: ZBVZeroBubble places exactly two stages on each rank",
        "parallel.pp_schedule=ZBVZeroBubble with compile.enabled=true",
        "parallel.pp_schedule=ZBVZeroBubble with parallel.activation_checkpointing=selective",
        "parallel.pp_schedule=ZBVZeroBubble with trainer.eval_every>0",
    ):
        assert line in problems, (line, problems)

    launched = ["parallel.pp=2", "parallel.pp_microbatches=1", "parallel.pp_layers=[1,2]"]  # on 1 process
    problems = "\n".join(config_problems(compose_config(launched)))
    assert "pp(2) * dp_replicate(1) * tp(1) = 2 does not divide world size 1" in problems
    assert "1F1B needs at least one micro-batch per stage (pp=2)" in problems
    assert "parallel.pp_layers=[1, 2] must give 2 stages" in problems and "pp_layers=[2,2]" in problems
    interleaved = ["dry_run=true", "parallel.pp=4", "parallel.pp_schedule=Interleaved1F1B"]
    assert config_problems(compose_config([*interleaved, "parallel.pp_microbatches=8"])) == []
    (problem,) = config_problems(
        compose_config([*interleaved, "parallel.pp_microbatches=9", "data.batch_size=9"])
    )
    assert "Interleaved1F1B runs them in pp_microbatches // pp(4) = 2 rounds" in problem


# ---------------------------------------------------------------------------------------------
# Planning and jobs
# ---------------------------------------------------------------------------------------------


def test_the_plan_gives_the_bubble_and_memory_per_pipeline_rank() -> None:
    cfg = compose_config([*RUN, "dry_run=true", "parallel.pp=2", "parallel.pp_microbatches=4"])
    plan = describe_plan(cfg)
    assert "pipeline: 1F1B, pp=2 x 1 stage(s) a rank, 4 micro-batches of 1 row(s)" in plan
    assert "bubble (p-1)/(m+p-1) = 20.0%" in plan
    rows = [line.split() for line in plan.splitlines() if line[:2] in ("0 ", "1 ")]
    (first, last) = rows
    assert first[1:3] == ["0", "0-1"] and last[1:3] == ["1", "2-3"]
    # 1F1B: the first stage holds pp micro-batches in flight, the last one; the parameters differ by
    # the embedding (first) against the final norm and head (last).
    assert (first[4], last[4]) == ("2", "1")
    assert int(first[3].replace(",", "")) + int(last[3].replace(",", "")) == 853_632


@pytest.mark.parametrize(
    "model",
    [["model.tie_embeddings=true"], ["model=deepseek_v3_debug", "model.mtp_layers=1"]],
    ids=["tied", "mtp"],
)
def test_the_plan_counts_the_last_stages_copy_of_the_embedding(model: list[str]) -> None:
    """A tied head and multi-token prediction's depths read the embedding on the last stage, which
    holds a copy: the stages together hold the model's parameters and one more embedding matrix."""
    cfg = compose_config([*RUN, *model, "dry_run=true", "parallel.pp=2"])
    rows = [line.split() for line in describe_plan(cfg).splitlines() if line[:2] in ("0 ", "1 ")]
    args = model_args(cfg.model)
    held = sum(int(row[3].replace(",", "")) for row in rows)
    assert held == args.num_params() + args.vocab_size * args.dim


def test_rendered_jobs_place_the_pipeline_across_hosts_and_tp_inside_one() -> None:
    overrides = [
        "recipe=llama8b",
        "parallel.launch.nodes=4",
        "parallel.launch.procs_per_node=8",
        "parallel.pp=2",
        "parallel.tp=8",
        "parallel.pp_microbatches=2",
    ]
    text = render_job(compose_config(overrides), overrides).text
    assert (
        "pp=2 x dp_replicate=1 x dp_shard=2 x tp=8 = 32 devices (tp groups inside one host each; each "
        "pipeline stage on 2 host(s) of its own)" in text
    )


# ---------------------------------------------------------------------------------------------
# Training under torchrun against one process
# ---------------------------------------------------------------------------------------------


ONE_PROCESS = [*RUN, "trainer.eval_every=3"]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict]]:
    """One process, global batch 4: the training records and the evaluation loss; and the training
    records of the same run in bf16 (``bf16``) and with tied embeddings (``tied``)."""
    run_dir = tmp_path_factory.mktemp("one")
    fit(ONE_PROCESS, run_dir)
    records = read_metrics(run_dir)
    bf16_dir = tmp_path_factory.mktemp("one_bf16")
    fit([*RUN, *BF16], bf16_dir)
    tied_dir = tmp_path_factory.mktemp("one_tied")
    fit([*RUN, TIED], tied_dir)
    return {
        "train": [r for r in records if "loss" in r],
        "eval": [r["eval_loss"] for r in records if "eval_loss" in r],
        "bf16": train_records(bf16_dir),
        "tied": train_records(tied_dir),
    }


def _assert_same_steps(got: list[dict], want: list[dict], what: str) -> None:
    assert [r["step"] for r in got] == [r["step"] for r in want], what
    for g, w in zip(got, want, strict=True):
        assert g["loss"] == pytest.approx(w["loss"], abs=1e-5), (what, g, w)
        assert g["grad_norm"] == pytest.approx(w["grad_norm"], rel=1e-5), (what, g, w)


def save_at_pp1(module_dir: Path) -> None:
    """The setup of the two-process launch (run in a fresh process): the one-process run's checkpoint
    of step 2 in ``from_pp1``'s run directory, which resumes it at pp=2 with two stages a rank."""
    fit([*ONE_PROCESS, "checkpoint.enabled=true", "checkpoint.every=2"], module_dir / "one")
    saved = module_dir / "one" / "checkpoints" / "step_0000002"
    shutil.copytree(saved, module_dir / "from_pp1" / "checkpoints" / "step_0000002")


INTERLEAVED = ["parallel.pp_virtual_stages=2", "parallel.pp_microbatches=4"]
# Every schedule on 2 processes; the 1F1B run saves at step 2 (the pp=1 and pp=4 resumes start there).
TWO_PROCESSES = {
    "GPipe": [*RUN, *PP2, "parallel.pp_schedule=GPipe"],
    # 1F1B evaluates through the pipeline, takes the chunked loss, and saves at step 2.
    "1F1B": [
        *RUN,
        *PP2,
        "trainer.eval_every=3",
        "trainer.loss=chunked",
        "checkpoint.enabled=true",
        "checkpoint.every=2",
    ],
    "Interleaved1F1B": [
        *RUN,
        *PP2,
        *INTERLEAVED,
        "parallel.pp_schedule=Interleaved1F1B",
        "trainer.eval_every=3",
    ],
    "InterleavedZeroBubble": [*RUN, *PP2, *INTERLEAVED, "parallel.pp_schedule=InterleavedZeroBubble"],
    "1F1B_bf16": [*RUN, *PP2, *BF16],
    # One matrix at both ends: the last of the 4 stages (on rank 1) holds a copy of the first's.
    "Interleaved1F1B_tied": [*RUN, *PP2, *INTERLEAVED, "parallel.pp_schedule=Interleaved1F1B", TIED],
    "ZBVZeroBubble": [
        *RUN,
        *PP2,
        "parallel.pp_virtual_stages=2",
        "parallel.pp_schedule=ZBVZeroBubble",
        "parallel.activation_checkpointing=full",
    ],
    "from_pp1": [
        *RUN,
        *PP2,
        *INTERLEAVED,
        "parallel.pp_schedule=Interleaved1F1B",
        "checkpoint.resume=auto",
    ],
}
two_processes = shared_launch.declare("two_processes", 2, TWO_PROCESSES, setup=save_at_pp1)


@pytest.mark.slow
def test_every_schedule_on_two_processes_matches_one_process_and_checkpoints_move(
    one_process, two_processes, tmp_path: Path
) -> None:
    dirs = two_processes
    want = one_process["train"]
    for name in dirs:
        if name not in ("from_pp1", "1F1B_bf16", "Interleaved1F1B_tied"):
            _assert_same_steps(train_records(dirs[name]), want, name)
    _assert_same_steps(train_records(dirs["Interleaved1F1B_tied"]), one_process["tied"], "tied embeddings")
    # bf16 (autocast; the stages exchange bf16 and fp32 activations as autocast leaves them) against
    # one process in bf16: two bf16 runs of the 4-block debug model, within the bound derived in
    # tests/helpers.py (losses 9.9e-2, gradient norms 1.7e-1 relative; measured: 4e-5 and 3e-4).
    bf16 = train_records(dirs["1F1B_bf16"])
    n_layers = model_args(compose_config(RUN).model).n_layers
    loss_bound = bf16_tolerance(2 * decoder_roundings(n_layers))
    grad_bound = bf16_tolerance(2 * decoder_roundings(n_layers, backward=True))
    assert [r["step"] for r in bf16] == [r["step"] for r in one_process["bf16"]]
    for got, ref in zip(bf16, one_process["bf16"], strict=True):
        assert got["loss"] == pytest.approx(ref["loss"], rel=loss_bound), (got, ref)
        assert got["grad_norm"] == pytest.approx(ref["grad_norm"], rel=grad_bound), (got, ref)
    _assert_same_steps(train_records(dirs["from_pp1"]), want[2:], "pp=1 -> pp=2 x 2 stages")
    for name in ("1F1B", "Interleaved1F1B"):  # evaluation through the pipeline, forward only
        evals = [r["eval_loss"] for r in read_metrics(dirs[name]) if "eval_loss" in r]
        assert evals == pytest.approx(one_process["eval"], abs=1e-5), name

    # The pp=2 checkpoint of step 2 holds the unsplit model's names and resumes in one process.
    saved = dirs["1F1B"] / "checkpoints" / "step_0000002"
    fit([*RUN, f"checkpoint.resume={saved}"], tmp_path / "to_pp1")
    _assert_same_steps(train_records(tmp_path / "to_pp1"), want[2:], "pp=2 -> pp=1")
    out = run_cli(["export", f"checkpoint={saved}", f"out={tmp_path / 'hf'}"], cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert (tmp_path / "hf" / "config.json").is_file()


DP2 = ["parallel.dp_shard=2", "data.batch_size=2"]  # the global batch stays 4 rows
four_processes = shared_launch.declare(
    "four_processes",
    4,
    {
        "pp2_dp2": [*RUN, *PP2, *DP2],
        "pp2_dp2_interleaved_compiled": [
            *RUN,
            *PP2,
            *DP2,
            "parallel.pp_schedule=Interleaved1F1B",
            "parallel.pp_virtual_stages=2",
            "parallel.activation_checkpointing=full",
            "compile.enabled=true",
            "compile.backend=aot_eager",
        ],
        "pp2_tp2": [*RUN, *PP2, "parallel.tp=2", "parallel.activation_checkpointing=selective"],
        # Tied: the copy's vocabulary shards summed with the embedding's (tp); first and last of 4 stages.
        "pp2_tp2_tied": [*RUN, *PP2, "parallel.tp=2", TIED],
        "pp4_tied": [*RUN, "parallel.pp=4", "parallel.pp_microbatches=4", TIED],
        # The two-process launch's 1F1B checkpoint (it runs first: launches go in order of size).
        "pp2_to_pp4": [
            *RUN,
            "parallel.pp=4",
            "parallel.pp_microbatches=4",
            f"checkpoint.resume={shared_launch.module_path('1F1B', 'checkpoints', 'step_0000002')}",
        ],
    },
)


@pytest.mark.slow
def test_pp2_with_fsdp2_and_with_tp2_on_four_processes_matches_one_process(
    one_process, two_processes, four_processes
) -> None:
    """pp2 x dp2 (also interleaved, checkpointed and compiled) and pp2 x tp2 against one process (tied
    embeddings too, and at pp=4); the checkpoint two processes saved at pp=2 (step 2) resumes at pp=4,
    one block a stage, on four."""
    assert (two_processes["1F1B"] / "checkpoints" / "step_0000002").is_dir()
    want = {name: one_process["tied" if "tied" in name else "train"] for name in four_processes}
    want["pp2_to_pp4"] = one_process["train"][2:]
    for name, run_dir in four_processes.items():
        _assert_same_steps(train_records(run_dir), want[name], name)


@pytest.mark.slow
def test_pp2_dp2_tp2_on_eight_processes_matches_one_process(one_process, tmp_path: Path) -> None:
    runs = {"pp2_dp2_tp2": [*RUN, *PP2, "parallel.dp_shard=2", "parallel.tp=2", "data.batch_size=2"]}
    dirs = launch_runs(8, runs, tmp_path)
    _assert_same_steps(train_records(dirs["pp2_dp2_tp2"]), one_process["train"], "pp2 x dp2 x tp2")


# ---------------------------------------------------------------------------------------------
# Stop signals and kill -9, as without a pipeline (tests/test_faults.py, tests/test_elastic.py)
# ---------------------------------------------------------------------------------------------


def _fault_worker(
    run_dir: Path, overrides: list[str], torchrun_args: tuple[str, ...] = (), **fault: str
) -> subprocess.CompletedProcess:
    """A pp=2 launch of ``tests/fault_injection.py`` (the CLI with the kill hook; ``fault``: its
    ``FAULT_*`` variables, none armed by default): 4 steps, a checkpoint each step, the last 2 kept."""
    env = {
        **launch_env(),
        "FAULT_KILL_AT": "0",
        "FAULT_RANK": "0",
        "FAULT_MARKER": str(run_dir.parent / "none"),
    }
    return subprocess.run(
        [
            *torchrun_command(2, *torchrun_args),
            str(ROOT / "tests" / "fault_injection.py"),
            *fault_injection.RUN,
            *PP2,
            "trainer.steps=4",
        ]
        + [f"run_dir={run_dir}", *overrides],
        cwd=run_dir.parent,
        env={**env, **fault},
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.slow
def test_sigkill_of_a_pipeline_rank_during_a_save_resumes_from_the_newest_whole_checkpoint(
    tmp_path: Path,
) -> None:
    """A pipeline rank SIGKILLed at a random point of a save (or a rotation): every checkpoint left is
    whole, the attempt torchrun restarts resumes from the newest and trains with the clean run's
    losses, bitwise."""
    count = tmp_path / "count"
    clean = _fault_worker(tmp_path / "clean", [], FAULT_COUNT_FILE=str(count))
    assert clean.returncode == 0, clean.stderr[-3000:]
    reference = step_losses(tmp_path / "clean")
    assert sorted(reference) == list(range(1, 5))
    points = {rank: int(Path(f"{count}.rank{rank}").read_text()) for rank in (0, 1)}
    assert min(points.values()) >= 4  # each rank writes its stage's shards in every one of 4 saves

    rng = random.Random(24)
    rank = rng.randint(0, 1)
    kill_at = rng.randint(1, points[rank])
    context = f"rank {rank} killed at point {kill_at} of {points[rank]}\n"
    run_dir, marker, found = tmp_path / "killed", tmp_path / "killed.marker", tmp_path / "found.json"
    fault = {
        "FAULT_KILL_AT": str(kill_at),
        "FAULT_RANK": str(rank),
        "FAULT_MARKER": str(marker),
        "FAULT_FOUND_FILE": str(found),
    }
    # One launch: the kill fails the first attempt, torchrun restarts it (the marker disarms the
    # kill), and the restarted rank 0 inspects every step_N left behind before it resumes.
    resumed = _fault_worker(run_dir, ["checkpoint.resume=auto"], ("--max-restarts=1",), **fault)
    context += resumed.stderr[-3000:]
    assert marker.exists() and found.exists(), context  # killed, then restarted
    outcome = json.loads(found.read_text())
    assert "error" not in outcome, context + str(outcome)  # every step_N left behind is whole
    assert resumed.returncode == 0, context
    if outcome["complete"]:
        log = resumed.stdout + resumed.stderr
        newest = run_dir / "checkpoints" / outcome["complete"][-1]
        assert f"resumed from {newest} at step" in log, context + log[-3000:]
    assert step_losses(run_dir) == reference, context


@pytest.mark.slow
def test_sigterm_to_a_pipelined_portatrain_torchrun_saves_and_exits_0(tmp_path: Path) -> None:
    args = [*TINY, *PP2, "trainer.steps=100000", "run_dir=run", "trainer.progress=true"]
    status, output = sigterm_portatrain_torchrun(args, tmp_path)
    assert status == 0, output[-4000:]
    assert "every worker saved and ended cleanly" in output
    (saved,) = complete_checkpoints(tmp_path / "run" / "checkpoints")
    inspect_checkpoint(saved)  # both stages' shards and the unsplit names' index are whole


SIM = [*RUN, *PP2, "device=sim"]
# A launch of its own: its process group takes the sim device's backend.
four_sim_processes = shared_launch.declare(
    "four_sim_processes",
    4,
    {
        "sim_pp2_dp2": [*SIM, "parallel.dp_shard=2", "data.batch_size=2", "trainer.eval_every=3"],
        "sim_pp2_tp2_interleaved": [
            *SIM,
            "parallel.tp=2",
            "parallel.pp_schedule=Interleaved1F1B",
            "parallel.pp_virtual_stages=2",
            "parallel.pp_microbatches=4",
        ],
    },
)


@pytest.mark.slow
def test_pp2_with_fsdp2_and_with_tp2_on_the_sim_device_matches_one_process(
    one_process, four_sim_processes
) -> None:
    """``device=sim``, 4 processes: activations and gradients cross between the stages through the sim
    device's process-group backend (``simccl``), whose sends and receives complete at ``wait()`` as
    gloo's do (a send that waited for its receiver deadlocked the two stages, which both send first);
    FSDP2 and TP inside each stage take its collectives."""
    dirs = four_sim_processes
    for name, run_dir in dirs.items():
        _assert_same_steps(train_records(run_dir), one_process["train"], f"{name} on sim")
    evals = [r["eval_loss"] for r in read_metrics(dirs["sim_pp2_dp2"]) if "eval_loss" in r]
    assert evals == pytest.approx(one_process["eval"], abs=1e-5)
