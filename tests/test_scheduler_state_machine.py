"""The stateful Hypothesis test over scheduler + KV cache (docs/DESIGN.md invariants 1-8)."""

from hypothesis import HealthCheck, settings

from tokenbudget.testing.state_machine import SchedulerMachine

TestSchedulerMachine = SchedulerMachine.TestCase
TestSchedulerMachine.settings = settings(max_examples=400, stateful_step_count=60, deadline=None,
                                         suppress_health_check=[HealthCheck.too_slow])
