"""The stateful Hypothesis test over scheduler + KV cache (docs/DESIGN.md invariants 1-8).

250 programs: since each starts with a batch in flight and steps in runs (``step_a_while``),
they cost ~4x the old ones and reach ~2x the events (benches/RESULTS.md, "Fuzzing: what the
state machine's programs reach")."""

from hypothesis import HealthCheck, settings

from tokenbudget.testing.state_machine import SchedulerMachine

TestSchedulerMachine = SchedulerMachine.TestCase
TestSchedulerMachine.settings = settings(max_examples=250, stateful_step_count=60, deadline=None,
                                         suppress_health_check=[HealthCheck.too_slow])
