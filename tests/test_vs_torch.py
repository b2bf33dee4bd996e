"""The torch.distributed.pipelining comparison's pieces that need no torch: where the
peer's virtual stages live, and the report (benchmarks/vs_torch.py)."""

from benchmarks import peer_torch, vs_torch


def test_peer_places_virtual_stages_as_its_schedules_expect():
  # looped (interleaved): rank r holds r and r + n; a V (ZB-V, DualPipeV): r and 2n - 1 - r
  assert [peer_torch._stages_of(r, 2, "one") for r in range(2)] == [[0], [1]]
  assert [peer_torch._stages_of(r, 2, "loop") for r in range(2)] == [[0, 2], [1, 3]]
  assert [peer_torch._stages_of(r, 2, "v") for r in range(2)] == [[0, 3], [1, 2]]
  assert set(vs_torch.PEER) <= set(peer_torch.SCHEDULES)


def test_report_gives_each_schedule_and_the_best_of_each():
  ours = {"1f1b/8": [10.0, 12.0, 11.0], "ooo/8": [9.0, 9.5, 9.2]}
  peer = {"1f1b/8": [20.0, 22.0, 21.0], "dualpipe-v/8": [18.0, 18.5, 19.0]}
  bases = {
    "ours": {"baseline": [9.0], "accum/8": [18.4]},
    "peer": {"baseline": [27.0], "accum/8": [37.0]},
  }
  lines = vs_torch.table(ours, peer, "unshaped", bases)
  assert "| 1f1b | 8 | 11.0 [10.0-12.0] | 21.0 [20.0-22.0] | 1.91x |" in lines
  assert "| dualpipe-v | 8 | - | 18.5 [18.0-19.0] |  |" in lines
  (best,) = [x for x in lines if x.startswith("- 8 microbatches")]
  assert "ooojax ooo 9.2 ms, torch dualpipe-v 18.5 ms: **2.01x**" in best
  assert "ooojax 0.98x / 2.00x, torch 1.46x / 2.00x" in best
