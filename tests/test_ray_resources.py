"""How many Ray Data actors, and how many CPUs each (``integrations.ray.resources.plan_actors``):
never more CPUs per actor than a node has (Ray would leave it pending forever), one CPU of the
cluster left for Ray Data's read and write tasks, and the values a user sets kept. Pure
arithmetic on ``ray.nodes()``-shaped dicts: no Ray needed."""

from __future__ import annotations

import logging

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tokenbudget.integrations.ray.resources import plan_actors


def test_two_cpus_give_one_actor_of_one_cpu():
    plan = plan_actors([{"CPU": 2.0}], None, None, 0.0)
    assert (plan.concurrency, plan.num_cpus) == (1, 1.0)


def test_four_nodes_of_sixteen_give_an_actor_per_node():
    plan = plan_actors([{"CPU": 16.0}] * 4, None, None, 0.0)
    assert (plan.concurrency, plan.num_cpus) == (4, 15.0)


def test_gpus_give_one_cpu_per_actor_and_an_actor_per_gpu():
    plan = plan_actors([{"CPU": 16.0, "GPU": 2.0}], None, None, 1.0)
    assert (plan.concurrency, plan.num_cpus, plan.num_gpus) == (2, 1.0, 1.0)


def test_more_cpus_or_gpus_than_any_node_has_is_refused_by_name():
    with pytest.raises(ValueError, match="num_cpus=4"):
        plan_actors([{"CPU": 2.0}], None, 4.0, 0.0)
    with pytest.raises(ValueError, match="num_gpus=1"):
        plan_actors([{"CPU": 2.0}], None, None, 1.0)
    with pytest.raises(ValueError, match="no node with a CPU"):
        plan_actors([], None, None, 0.0)


def test_set_values_are_kept_and_a_full_cluster_is_warned_about(caplog):
    with caplog.at_level(logging.WARNING, logger="tokenbudget"):
        plan = plan_actors([{"CPU": 2.0}], 2, 1.0, 0.0)
    assert (plan.concurrency, plan.num_cpus) == (2, 1.0)
    assert "read and write tasks" in caplog.text


@given(st.lists(st.integers(1, 64), min_size=1, max_size=8))
def test_defaults_always_fit_and_leave_a_cpu_for_ray_data(node_cpus):
    nodes = [{"CPU": float(c)} for c in node_cpus]
    plan = plan_actors(nodes, None, None, 0.0)
    assert plan.num_cpus <= min(node_cpus)  # every actor fits on every node
    assert sum(int(c // plan.num_cpus) for c in node_cpus) >= plan.concurrency  # they all get placed
    if sum(node_cpus) > 1:
        assert plan.concurrency * plan.num_cpus <= sum(node_cpus) - 1  # a CPU stays for reading
