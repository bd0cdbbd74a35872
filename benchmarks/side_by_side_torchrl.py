"""Side by side with TorchRL's LLM pieces: the figures of the comparison table in docs/comparison.md.

Compares, on the same two responses (2 and 4 valid tokens, policy log-prob log 0.5, reference
log 0.25 on every token):

1. the in-loss reference KL of ``TokenPPOLoss(kl_to_ref_coeff=1)`` and of TorchRL's ``GRPOLoss``
   (its ``_kl_to_ref``, the ``loss_kl_to_ref`` term of its forward) with the responses
   right-padded to R = 4, 8 and 32 tokens;
2. the per-token rewards of a sequence score (1 and 3) with a k1 KL penalty beta = 0.5 from
   ``KLPenaltyTransform`` and from TorchRL's ``KLComputation`` (the reward step of ``RetrieveKL``).

Both sides are computed in this run: ours by the functions that ``tests/test_torchrl_side_by_side.py``
tests (imported from there), ``GRPOLoss``'s in-loss KL here, through its private ``_kl_to_ref``
(the test suite does not pin TorchRL's internals):

    python benchmarks/side_by_side_torchrl.py
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout
sys.path.insert(0, str(ROOT / "tests"))

from test_torchrl_side_by_side import K3, LENGTHS, _padded, ours_kl, ours_rewards, torchrl_rewards  # noqa: E402


def grpo_kl(R: int) -> float:
    """TorchRL's ``GRPOLoss`` in-loss KL (``kl_to_ref_coeff = 1``) of the responses padded to ``R``."""
    from torchrl.objectives.llm import GRPOLoss

    td = _padded(R)
    loss = GRPOLoss(None, kl_to_ref_coeff=1.0)
    td.set("_cur_log_prob", td["lp_in"])
    weighted, _ = loss._kl_to_ref(td, ref_log_prob=td["ref_log_prob"], mask=td["mask"])
    return float(weighted)


def main() -> None:
    import torchrl

    print(f"torchrl {torchrl.__version__} ({Path(torchrl.__file__).parent})")
    print(f"\nIn-loss reference KL (k3 per valid token = {K3:.4f}); responses of {LENGTHS} tokens padded to R:")
    print("| R | TokenPPOLoss loss_kl_ref | GRPOLoss loss_kl_to_ref | GRPOLoss / ours |")
    print("|---|---|---|---|")
    for R in (4, 8, 32):
        ours, theirs = ours_kl(R), grpo_kl(R)
        print(f"| {R} | {ours:.4f} | {theirs:.4f} | {theirs / ours:.3f} |")
    print("\nSequence scores (1, 3) with a k1 penalty, beta = 0.5: the rewards of each response's tokens")
    print("| response | KLPenaltyTransform | sum | KLComputation (RetrieveKL) | sum |")
    print("|---|---|---|---|---|")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch's nested-tensor prototype warning
        theirs = torchrl_rewards(0.5)
    for i, (a, b) in enumerate(zip(ours_rewards(0.5), theirs)):
        fmt = lambda x: "[" + ", ".join(f"{v:.4f}" for v in x.tolist()) + "]"  # noqa: E731
        print(f"| {i} ({LENGTHS[i]} tokens) | {fmt(a)} | {float(a.sum()):.4f} | {fmt(b)} | {float(b.sum()):.4f} |")


if __name__ == "__main__":
    main()
