"""Build the speculation a ``SpeculativeConfig`` asks for: its proposer, the draft-length
controller with its measured cost model, and the ``Speculator`` over both."""

from __future__ import annotations

from tokenbudget.api.spec_config import SpeculativeConfig
from tokenbudget.spec.speculator import Speculator


def build_proposer(config: SpeculativeConfig, max_model_len: int, target=None, scheduler=None, runner=None):
    """Model drafters need the engine's ``TargetModel`` and ``Scheduler`` (KV block tables); the
    EAGLE-3 drafter also the ``ModelRunner`` (it switches the target's tap states on)."""
    if config.method == "ngram":
        from tokenbudget.spec.ngram import NgramProposer
        return NgramProposer.from_config(config, max_model_len)
    if config.method == "suffix":
        from tokenbudget.spec.suffix import SuffixProposer
        return SuffixProposer.from_config(config, max_model_len)
    if config.method in ("draft_model", "self_draft"):
        from tokenbudget.engine.drafters.draft_model import DraftModelProposer
        return DraftModelProposer.from_config(config, max_model_len, target, scheduler)
    if config.method == "eagle3":
        from tokenbudget.engine.drafters.eagle3_build import build_eagle3_proposer
        return build_eagle3_proposer(config, max_model_len, target, scheduler, runner)
    raise ValueError(f"speculative_config['method'] {config.method!r} is not supported")


def build_controller(config: SpeculativeConfig, cost_model=None):
    """The draft-length controller for ``"auto"`` (None otherwise); ``cost_model`` is the engine's
    measured ``spec.cost_model.StepCostModel``."""
    if not config.is_adaptive:
        return None
    from tokenbudget.spec.adaptive import AdaptiveSpecController
    return AdaptiveSpecController.from_config(config, cost_model=cost_model)


def build_speculator(spec_config: SpeculativeConfig, target, scheduler, runner) -> Speculator:
    """The engine's ``Speculator``: the proposer, and under ``"auto"`` the controller whose cost
    model's prior is timed on ``runner`` (and the drafter) now (``step_cost``)."""
    proposer = build_proposer(spec_config, scheduler.config.max_model_len, target=target, scheduler=scheduler,
                              runner=runner)
    cost_model = None
    if spec_config.is_adaptive:
        from tokenbudget.engine.drafters.step_cost import measure_runner_costs
        cost_model = measure_runner_costs(runner, scheduler.config, drafter=proposer)
    return Speculator(spec_config, proposer, build_controller(spec_config, cost_model))
