"""The drafters that run a model, beside the target's runner: a draft model or the target's first
layers (``draft_model``, its ``DraftRunner`` and the sampling every model drafter shares), the
EAGLE-3 head over the target's tap states (``eagle3_*``), the start-up cost probe of the runner and
the drafter (``step_cost``) and the factory that builds a ``SpeculativeConfig``'s proposer
(``factory``). The policy (the proposer protocol, n-gram and suffix drafters, the draft-length
controller and its cost model) is ``spec/``, below the engine.
"""
