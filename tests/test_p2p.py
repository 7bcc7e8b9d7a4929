"""NCCL P2P settings from the GPUs' links: pairs without P2P never reach NCCL with P2P on (it hangs there)."""

from __future__ import annotations

import logging

import pytest

from mgpu.planning.devices import parse_spec
from mgpu.ranks import p2p
from mgpu.ranks.pool import PoolConfig, RankPool


def test_all_pairs_with_p2p_change_nothing():
    for spec in ("2x24GiB:p2p", "4x80GiB:nvlink"):
        gpus = parse_spec(spec)
        assert p2p.decide(gpus, [d.id for d in gpus], {}) == p2p.P2pDecision()


def test_two_consumer_gpus_without_p2p_get_nccl_p2p_off():
    gpus = parse_spec("2x24GiB:pcie")
    decision = p2p.decide(gpus, ["cuda:0", "cuda:1"], {})
    assert decision.env == {"NCCL_P2P_LEVEL": "NVL"}
    assert "cuda:0-cuda:1" in decision.reason and "no peer-to-peer" in decision.reason


def test_nvlink_pairs_keep_p2p_when_only_the_pcie_pairs_lack_it():
    gpus = parse_spec("2x80GiB:nvlink,2x80GiB:nvlink")   # two NVLink pairs, plain PCIe between the pairs
    decision = p2p.decide(gpus, [d.id for d in gpus], {})
    assert decision.env == {"NCCL_P2P_LEVEL": "NVL"}
    assert "NVLink pairs keep P2P" in decision.reason
    assert "cuda:0-cuda:2" in decision.reason and "cuda:0-cuda:1" not in decision.reason


def test_mixed_pcie_p2p_and_none_disables_p2p_for_all():
    gpus = parse_spec("2x24GiB:p2p,1x24GiB")   # cuda:2 reaches the others without P2P
    decision = p2p.decide(gpus, ["cuda:0", "cuda:1", "cuda:2"], {})
    assert decision.env == {"NCCL_P2P_DISABLE": "1"}
    assert "cuda:0-cuda:2" in decision.reason and "cuda:1-cuda:2" in decision.reason


def test_only_the_ranks_gpus_count():
    gpus = parse_spec("2x24GiB:p2p,1x24GiB")
    assert p2p.decide(gpus, ["cuda:0", "cuda:1"], {}) == p2p.P2pDecision()


@pytest.mark.parametrize("var", p2p.USER_VARS)
def test_the_users_setting_wins(var):
    gpus = parse_spec("2x24GiB:pcie")
    assert p2p.decide(gpus, ["cuda:0", "cuda:1"], {var: "0"}) == p2p.P2pDecision()


def test_unknown_links_change_nothing():
    gpus = [g.__class__(**{**g.__dict__, "links": ()}) for g in parse_spec("2x24GiB:pcie")]
    assert p2p.decide(gpus, ["cuda:0", "cuda:1"], {}) == p2p.P2pDecision()


def test_the_pool_starts_nccl_ranks_with_the_decision(monkeypatch, caplog):
    """The rank environment the pool builds for NCCL ranks on two GPUs without P2P, and its one log line."""
    monkeypatch.setattr("mgpu.ranks.pool.live_gpus", lambda: parse_spec("2x24GiB:pcie"))
    for var in p2p.USER_VARS:
        monkeypatch.delenv(var, raising=False)
    pool = RankPool(PoolConfig(devices=["cuda:0", "cuda:1"]))
    with caplog.at_level(logging.WARNING, logger="mgpu.ranks.pool"):
        env = pool._rank_env("nccl")
    assert env["NCCL_P2P_LEVEL"] == "NVL"
    assert any("no peer-to-peer" in r.getMessage() for r in caplog.records)
    assert "NCCL_P2P_LEVEL" not in pool._rank_env("gloo")
    monkeypatch.setenv("NCCL_P2P_DISABLE", "0")
    assert pool._rank_env("nccl")["NCCL_P2P_DISABLE"] == "0" and "NCCL_P2P_LEVEL" not in pool._rank_env("nccl")
