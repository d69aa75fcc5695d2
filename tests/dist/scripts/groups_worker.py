"""Worker for tests/dist/test_reloadable_groups.py: process groups destroyed and rebuilt, over gloo.

Job ``groups`` of tests/dist/harness.py (2 ranks): argv = [OUT_JSON]
Checks on every rank, twice (two sleep/wake cycles): the collectives megatron uses (all_reduce,
broadcast with a global source, all_gather_into_tensor, the coalescing manager, batched P2P,
all_gather_object) on wrapped groups; after destroy() a collective raises GroupsDestroyed naming
the group while rank/size queries still answer; after reload() the same collectives give the
same results; a non-member's record is replayed too (a group of rank 0 alone).
"""

import json

import torch
import torch.distributed as dist


def collectives(pair, solo) -> dict:
    rank = dist.get_rank()
    out = {}
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t, group=pair)
    out["all_reduce"] = t.item()
    b = torch.tensor([float(rank * 10)])
    dist.broadcast(b, src=1, group=pair)
    out["broadcast"] = b.item()
    g = torch.empty(2)
    dist.all_gather_into_tensor(g, torch.tensor([float(rank)]), group=pair)
    out["all_gather"] = g.tolist()
    a, c = torch.tensor([1.0 + rank]), torch.tensor([2.0 * rank])
    with dist._coalescing_manager(group=pair):
        dist.all_reduce(a, group=pair)
        dist.all_reduce(c, group=pair)
    out["coalesced"] = [a.item(), c.item()]
    peer = 1 - rank
    recv = torch.empty(1)
    ops = [dist.P2POp(dist.isend, torch.tensor([float(rank + 100)]), peer, pair),
           dist.P2POp(dist.irecv, recv, peer, pair)]
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    out["p2p"] = recv.item()
    objs = [None, None]
    dist.all_gather_object(objs, {"rank": rank}, group=pair)
    out["objects"] = objs
    out["ranks"] = dist.get_process_group_ranks(pair)
    out["solo"] = None if solo is dist.GroupMember.NON_GROUP_MEMBER else dist.get_world_size(solo)
    return out


def main(argv):
    from megatron_rl.infra import reloadable_groups as rg

    rg.install()
    pair = dist.new_group([0, 1], group_desc="TEST_PAIR")
    solo = dist.new_group([0])  # rank 1 is not a member: its record is replayed all the same
    assert isinstance(pair, rg.ReloadableGroup), type(pair)
    results = {"before": collectives(pair, solo), "cycles": []}
    registered = len(dist.distributed_c10d._world.pg_map)  # torch's own table of live groups (WORLD too)
    for _ in range(2):
        destroyed = rg.destroy()
        cycle = {"destroyed": destroyed, "is_destroyed": rg.is_destroyed(), "registered_before": registered,
                 "registered_while_destroyed": len(dist.distributed_c10d._world.pg_map),
                 "rank_while_destroyed": dist.get_rank(pair), "size_while_destroyed": dist.get_world_size(pair),
                 "ranks_while_destroyed": dist.get_process_group_ranks(pair)}
        try:
            dist.all_reduce(torch.ones(1), group=pair)
            cycle["error"] = None
        except rg.GroupsDestroyed as e:
            cycle["error"] = str(e)
        dist.barrier()  # WORLD is kept
        cycle["rebuilt"] = rg.reload()
        cycle["registered_after"] = len(dist.distributed_c10d._world.pg_map)
        cycle["after"] = collectives(pair, solo)
        results["cycles"].append(cycle)
    dist.destroy_process_group(pair)  # retired: not rebuilt again
    results["after_retire"] = {"destroyed": rg.destroy(), "rebuilt": rg.reload()}
    rg.uninstall()
    gathered = [None, None]
    dist.all_gather_object(gathered, results)
    if dist.get_rank() == 0:
        with open(argv[0], "w") as fh:
            json.dump(gathered, fh)
