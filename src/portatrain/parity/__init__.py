"""Numerical parity of a device against an fp32 CPU reference, module by module.

``portatrain parity recipe=... device=...`` (``portatrain.commands.parity``) calls :func:`run_parity`:
two Trainers are built from the same config in one process, one on the target device and one on
the CPU in float32 with no kernel overrides. The target gets the reference's initial weights, both
train on the same batches for ``trainer.steps`` steps, and every step records the loss, each
module's output (forward hooks), each parameter's gradient and the target's optimizer update.
Differences are relative (``max|target - reference| / max|reference|``), each judged against a
tolerance derived from the arithmetic (below), never tuned to one machine's kernels. The first
divergence is named: the earliest step, and in it the first module, in execution order, whose
output left its tolerance. Forward hooks fire when a module returns, so a leaf
(``layers.1.input_layernorm``) is named before the block that contains it.

What is comparable, and its tolerance
-------------------------------------
**Step 1** starts from identical weights and batches, so its module outputs, gradients and loss
differ by rounding alone: two sets of kernels sum in different orders (blocking, vector width,
threads, fused or decomposed attention). Each is judged against

    tol = λ · sqrt(σ_target² + σ_reference²),    σ_side = sqrt(L) · (sqrt(K) · u_fp32 + u_side)

* ``u`` is the unit roundoff of a dtype (fp32 2^-24, bf16 2^-8, fp16 2^-11); ``u_side`` that of the
  side's compute dtype, and reductions accumulate in fp32 on every backend (``u_fp32``).
* ``K`` is the step's longest reduction: the largest dimension of a matrix parameter (a matmul's
  inner dimension either way, the vocabulary a softmax sums over) or the tokens a weight gradient
  sums over. A length-K dot product summed in any order is off by at most γ_K = K·u/(1 - K·u) times
  ``Σ|a_k b_k|`` (Higham, *Accuracy and Stability of Numerical Algorithms*, 2nd ed., §3.1); with
  rounding errors independent and of mean zero it grows as sqrt(K)·u instead (Higham & Mary, "A New
  Approach to Probabilistic Rounding Error Analysis", SIAM J. Sci. Comput. 41(5), 2019), relative
  to the scale of the result, which is what ``max|reference|`` measures.
* ``L`` counts rounding stages: twice (forward and backward) the modules that ran, each at least
  one rounded result. An error made in one stage reaches the end with a gain of about one (the
  residual stream; normalizations keep relative errors), and independent stages add in
  quadrature, hence sqrt(L).
* ``λ = 8``: a sum of many independent roundings is close to Gaussian, and P(|Z| > 8) ≈ 1.2e-15
  keeps the chance of a false alarm near one in a million over the ~1e9 elements a parity run of a
  small model compares.

On the debug recipe (K = 384, L = 102) that is 1.4e-4 in fp32; the sim and the CPU differ there by
6e-7 at most, on AVX2 and with ``ATEN_CPU_CAPABILITY=default``, one thread or two.

**Later steps** are not compared module by module. AdamW's update ``lr · m̂ / (sqrt(v̂) + ε)`` is
about ``lr · sign(g)`` wherever ``|g| ≫ ε``, so a gradient within rounding of zero, whose sign the
summation order decides, moves its weight by ``±lr`` on either side: a full-size difference, in a
few weights, from a rounding-size one. From step 2 on a correct device's module outputs differ by
far more than rounding (2e-4 for the sim on the debug recipe; 3e-3 with rounding-sized noise on
every gradient) while its losses agree to 1e-7. What stays comparable, at every step:

* the **optimizer update**: the target's step against the same optimizer in float64 on the host,
  with the reference's settings (learning rate, betas, epsilon, weight decay) and the target's own
  weights, gradients and state, so rounding in the gradients cannot move it. Adam's
  elementwise update is about ten fp32 roundings, each at most ``u · (|w| + lr · c_t)``, where
  ``c_t`` bounds ``|m̂| / sqrt(v̂)`` (Cauchy-Schwarz over the betas' weights: 1 at step 1, 1.17 at
  most for betas (0.9, 0.95)); the difference, over ``max|w| + lr · c_t``, is judged against
  ``16 · u`` of the parameter's dtype. Adam and AdamW only; another optimizer's update is shown as
  not checked;
* the **loss**, against ``tol + ||∇L|| · ||W_target - W_reference|| / |L|``: to first order the
  loss moves by ``∇L · ΔW``, which Cauchy-Schwarz bounds, with ``∇L`` the reference's gradient at
  that step and ``ΔW`` the weight difference the two runs had reached before it (zero at step 1).

The module outputs and gradients of later steps are still printed, and so is the norm-relative
weight distance ``||W_target - W_reference|| / ||W_reference||`` at the start of each step.

Scope: one process (the reference holds a full copy of the model), eager modules on both sides
(per-module capture needs hooks, which compiled blocks would trace; ``compile.enabled`` is turned
off), debug-to-small models (every activation of a step is kept on the host, the optimizer check
holds a float64 copy of the parameters and their state).

On the simulated device the report also names the operators that fell back to the CPU on the
target (``SIM_OP_PROFILE``: those outside the op-coverage profile of the impersonated backend, which
really run through the CPU fallback), each with its calls and first location, so a parity pass says
whether it held with the fallbacks a real backend would take.

Modules: ``tolerances.py`` (the arithmetic above), ``report.py`` (what a run found, and its
verdict), ``run.py`` (the two Trainers, the hooks that capture each step, :func:`run_parity`).
"""

from __future__ import annotations

from portatrain.parity.report import Difference, ParityReport, StepParity
from portatrain.parity.run import run_parity
from portatrain.parity.tolerances import (
    TAIL,
    UPDATE_ROUNDINGS,
    adam_update_bound,
    step_tolerance,
    unit_roundoff,
)

__all__ = [
    "TAIL",
    "UPDATE_ROUNDINGS",
    "Difference",
    "ParityReport",
    "StepParity",
    "adam_update_bound",
    "run_parity",
    "step_tolerance",
    "unit_roundoff",
]
