"""Fuzzing kit shipped with the package: fake model, fake drafter, strategies, state machine.

It drives the real ``EngineCore``, so it sits above the engine (docs/DESIGN.md, "Layers").
Users fuzz their own scheduler settings with ``tokenbudget fuzz --config FILE`` or by running
``tokenbudget.testing.state_machine.machine_for(config).TestCase`` under pytest.
"""
