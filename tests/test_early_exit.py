"""Early exit's layer count, chosen from measured agreement with the target
(specserve/methods/early_exit.py)."""

import torch

from specserve.methods.early_exit import _predicted, choose_layers, layer_agreement
from specserve.model.loading import load_model
from specserve.tools.testing import save_pair


def test_layers_that_change_nothing_agree_with_the_target_everywhere(tmp_path):
    target, _ = save_pair(tmp_path, layers=3)
    cpu = torch.device("cpu")
    model = load_model(str(target), cpu, torch.float32, num_slots=2, matmul_dtype="float32", row_invariant=False)
    runner = model.backend.runner
    last = runner.layers[-1]
    last.o.weight.zero_()  # the last layer adds nothing: its attention's and its MLP's outputs are 0
    last.down.weight.zero_()
    tokens = list(range(40, 80))
    agreement = layer_agreement(runner, tokens, start=10)
    assert set(agreement) == {1, 2} and agreement[2] == 1.0
    assert runner.free_slots == 2  # the slot it read through is given back
    choice = choose_layers(runner, model.tokenizer)
    assert 1 <= choice.layers <= 2 and 0 <= choice.agreement <= 1


def test_the_prediction_weighs_agreement_against_the_layers_cost():
    assert _predicted(1.0, 0.1) > _predicted(0.5, 0.1) > _predicted(0.5, 0.5)
    assert _predicted(0.0, 0.1) < 1  # drafts never kept: a round costs more than it makes
    assert abs(_predicted(1.0, 0.0) - 5.0) < 1e-9  # free and always right: K + 1 tokens a step
