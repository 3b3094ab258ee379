"""A fleet through the real commands, hosts as network namespaces (tests/fleet_scenario.py):
three edge relays -> two central relays (failover) -> Spark standalone (master and two
workers on hosts of their own) reading both central archives.

Faults: SIGKILL of an edge (4 times) and of a central relay, an edge cut off the network with one
sealed segment of its spool deleted meanwhile, an edge whose spool disk fills up.  Asserted:

* every request answered 202 reached a central archive, but for the deleted segment's;
* request_stats counts each request exactly once per edge: the ones answered 202 (plus
  the ones whose reply was lost to a SIGKILL and that did arrive), minus the deleted ones;
* the gaps table names exactly the deleted segment's sequence numbers of edge 8, and
  nothing else; origin_loss gives every other edge 0 missing.
"""

import json
import os
import threading

import pytest

pytest.importorskip("pyspark")

from conftest import TEST_JIT  # noqa: E402
from fleet_hosts import available  # noqa: E402
from fleet_scenario import (  # noqa: E402
    CENTRALS,
    EDGES,
    META,
    Fleet,
    Plan,
    archived_request_ids,
    read_tables,
    run_pipeline,
    run_traffic,
    standard_faults,
    start_spark,
)

pytestmark = pytest.mark.slow


def test_fleet_counts_every_request_once_and_names_the_lost_range(tmp_path):
    why = available()
    if why:
        if os.environ.get("CI"):
            pytest.fail(f"the fleet test must run in CI: {why}")
        pytest.skip(why)
    lines = []
    plan = Plan()
    with Fleet(tmp_path, plan, log=lines.append) as f:
        f.small_disk("edge9")
        for c in CENTRALS:
            f.start(c)
        for e in EDGES:
            f.start(e)
        # the cluster starts beside the traffic (its JVMs take a while)
        spark = {}

        def cluster():
            try:
                spark["url"] = start_spark(f, TEST_JIT)
            except BaseException as e:      # raised below, after the traffic
                spark["error"] = e
        th = threading.Thread(target=cluster)
        th.start()
        try:
            agents, faults = run_traffic(f, standard_faults)
            f.drained()
            # what the centrals received last is in their open segments: the archive has it
            # once they are sealed (--archive-seal-after 1s)
            deleted_ids = {json.loads(fr[2])["request_id"] for fr in faults["deleted"]
                           if fr[0] == b"fleet-production"}
            f.archived(set().union(*(a.answered for a in agents.values())) - deleted_ids)
            for name in (*EDGES, *CENTRALS):
                assert f.stop(name) == 0, name
        finally:
            th.join()
        if "error" in spark:
            raise spark["error"]
        master = spark["url"]
        out = str(tmp_path / "stats")
        text, seconds = run_pipeline(f, master, out, TEST_JIT)
        ids = archived_request_ids(f)
    tables = read_tables(out)
    deleted = faults["deleted"]
    deleted_ids = {json.loads(fr[2])["request_id"] for fr in deleted
                   if fr[0] == b"fleet-production"}
    deleted_seqs = sorted(META.unpack(fr[3])[5] for fr in deleted)
    figures = {e: (a.sent, len(a.answered), len(a.unknown), a.refused)
               for e, a in agents.items()}
    print("fleet:", "; ".join(lines))
    print(f"fleet: sent/202/no reply/refused per edge {figures}; deleted {len(deleted)} "
          f"records ({len(deleted_ids)} requests); edge9 disk_full gauge "
          f"{faults['edge9_disk_full']}; pipeline {seconds:.1f} s")
    print(text[-1500:])
    assert deleted_ids and deleted_seqs
    assert deleted_seqs == list(range(deleted_seqs[0], deleted_seqs[-1] + 1))
    assert not deleted_ids & set(ids)
    for edge, a in agents.items():
        assert a.answered and a.refused == 0, (edge, figures)
        lost = a.answered - deleted_ids - set(ids)
        assert not lost, (edge, sorted(lost)[:10])
        expected = (a.answered | {r for r in a.unknown if r in ids}) - deleted_ids
        counted = sum(r["count"] for r in tables["request_stats"]
                      if r["action"] == f"Fleet#{edge}")
        assert counted == len(expected), (edge, counted, len(expected))
    gaps = [(g["hop"], g["host"], g["device"], g["first_missing"], g["last_missing"])
            for g in tables["gaps"]]
    assert gaps == [("origin", "edge8", 8, deleted_seqs[0], deleted_seqs[-1])], gaps
    missing = {}
    for r in tables["origin_loss"]:
        missing[(r["host"], r["device"])] = missing.get((r["host"], r["device"]), 0) + \
            r["missing"]
    assert missing == {("edge7", 7): 0, ("edge8", 8): len(deleted_seqs), ("edge9", 9): 0}
    assert sum(r["missing"] for r in tables["loss"]) == 0
    assert {r["device"] for r in tables["loss"]} == set(CENTRALS.values())
    # each of edge 7's restarts declared the numbers it skipped: none of them is missing
    assert sum(r["skipped"] for r in tables["origin_loss"] if r["device"] == 7) > 0
    assert "copies of events that arrived more than once left out" in text
    assert faults["edge9_disk_full"] == 1
