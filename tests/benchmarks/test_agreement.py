"""benchmarks/agreement.py: where a greedy output leaves plain decoding, and whether the target ties there."""

import copy

import torch

from benchmarks.agreement import TIE_GAP, first_difference


def test_a_difference_at_two_equal_logits_is_a_tie_and_elsewhere_is_not(build_target):
    model = copy.deepcopy(build_target("llama"))  # shared by the session: its copy is changed below
    with torch.no_grad():  # tokens 7 and 9 get the same output row: their logits are equal everywhere
        model.get_output_embeddings().weight[9] = model.get_output_embeddings().weight[7]
    prompt = [3, 1, 4, 1, 5]
    logits = model(torch.tensor([prompt])).logits[0, -1]
    best = int(logits.argmax())
    other = next(t for t in range(logits.shape[0]) if t != best and logits[best] - logits[t] > 100 * TIE_GAP)
    plain = torch.tensor([[*prompt, best, 2]])
    assert first_difference(model, plain, plain.clone()) is None
    real = first_difference(model, plain, torch.tensor([[*prompt, other, 2]]))
    assert (real.at, real.plain, real.other) == (5, best, other) and not real.tie
    assert real.gap == (logits[best] - logits[other]).item() and "NOT a tie" in str(real)
    tied = first_difference(model, torch.tensor([[*prompt, 7]]), torch.tensor([[*prompt, 9]]))
    assert tied.gap == 0.0 and tied.tie and "an fp32 tie" in str(tied)
    stopped = first_difference(model, plain, plain[:, :6])
    assert stopped.at == 6 and stopped.gap is None and not stopped.tie
