"""Fuzzing kit shipped with the package: fake model, fake drafter, strategies, state machine.

Users fuzz their own scheduler settings with ``tokenbudget fuzz --config FILE`` or by running
``scheduler.testing.state_machine.machine_for(config).TestCase`` under pytest.
"""
