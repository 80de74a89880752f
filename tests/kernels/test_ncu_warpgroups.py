"""benchmarks/ncu_warpgroups.py: per-role sums of Nsight Compute's SASS stall samples, on a source page made up here."""
import gzip

from support import benchmark_module

NCU = benchmark_module("ncu_warpgroups")

HEADER = ["Address", "Source", NCU.SAMPLES, "Warp Stall Sampling (Not-issued Samples)", NCU.EXECUTED,
          "stall_long_sb", "stall_wait", "stall_long_sb (Not Issued)"]


def _page(tmp_path, rows):
    lines = ['"Kernel Name","k",'] + [",".join(f'"{c}"' for c in HEADER)]
    lines += [",".join(f'"{c}"' for c in r) for r in rows]
    path = tmp_path / "sass.csv.gz"
    with gzip.open(path, "wt") as f:
        f.write("\n".join(lines) + "\n")
    return str(path)


def test_roles_are_cut_at_setmaxnreg_and_waits_show_their_barrier(tmp_path):
    rows = [  # address, SASS, samples, not issued, executed, long_sb, wait, long_sb not issued
        ("0x100", "LDC R1, c[0x0][0x28]", 2, 2, 10, 0, 2, 0),
        ("0x110", "USETMAXREG.DEALLOC.CTAPOOL 0x38", 0, 0, 4, 0, 0, 0),
        ("0x120", "SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [R29+URZ], R28", 1, 1, 4, 1, 0, 1),
        ("0x130", "@!P0  BRA 0x300", 30, 30, 4, 30, 0, 30),
        ("0x140", "REDG.E.ADD.STRONG.GPU desc[UR4][R30.64], R5", 10, 5, 4, 0, 10, 0),
        ("0x150", "USETMAXREG.TRY_ALLOC.CTAPOOL UP0, 0xe0", 0, 0, 4, 0, 0, 0),
        ("0x160", "HGMMA.64x48x16.F32.BF16 R152, gdesc[UR56], RZ, !UPT", 57, 50, 4, 7, 50, 7),
    ]
    ins = NCU.read(_page(tmp_path, rows))
    assert [i[0] for i in ins] == [int(r[0], 16) for r in rows] and ins[3][4] == {"long_sb": 30, "wait": 0}
    regs = NCU.regions(ins)
    assert [r["samples"] for r in regs] == [2, 41, 57]
    assert regs[1]["name"].startswith("role 1 (setmaxnreg DEALLOC") and regs[1]["reasons"]["long_sb"] == 31
    out = NCU.report(ins, top=2)
    assert "role 1 (setmaxnreg DEALLOC 0x38): 41 samples (41.0 % of all)" in out
    assert "at mbarrier waits: 73.2 % of its samples, 1 sites" in out  # the retry branch's 30 of 41
    assert "at mbarrier waits: 0.0 % of its samples, 0 sites" in out  # the HGMMA role waits at none
    assert "role 2 (setmaxnreg ALLOC 0xe0): 57 samples (57.0 % of all)" in out
    wait = out.index("@!P0  BRA 0x300")  # the barrier wait shown with the instruction that waits
    assert out.index("SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [R29+URZ], R28", wait) > wait


def test_a_wait_is_its_branch_on_the_checks_predicate(tmp_path):
    """A retry branch counts as an mbarrier wait when its predicate was last written by the ``SYNCS.PHASECHK``, even
    with the check hoisted far above it; a branch on a predicate rewritten in between does not."""
    fill = [(f"0x{0x200 + 16 * k:x}", "FMUL R1, R2, R3", 0, 0, 4, 0, 0, 0) for k in range(20)]
    rows = [("0x100", "USETMAXREG.TRY_ALLOC.CTAPOOL UP0, 0xd8", 0, 0, 4, 0, 0, 0),
            ("0x110", "SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [R18+URZ], R3", 1, 1, 4, 1, 0, 1)]
    rows += fill + [("0x400", "@!P0  BRA 0x900", 40, 40, 4, 40, 0, 40),
                    ("0x410", "SYNCS.PHASECHK.TRANS64.TRYWAIT P1, [R19+URZ], R3", 0, 0, 4, 0, 0, 0),
                    ("0x420", "ISETP.GE.AND P1, PT, R5, RZ, PT", 0, 0, 4, 0, 0, 0),
                    ("0x430", "@!P1  BRA 0x980", 9, 9, 4, 9, 0, 9)]
    ins = NCU.read(_page(tmp_path, rows))
    body = NCU.regions(ins)[0]["ins"]
    assert NCU.wait_sites(body) == {22: 1}
    assert "at mbarrier waits: 80.0 % of its samples, 1 sites" in NCU.report(ins, top=1)


def test_shared_memory_wavefronts_are_summed_per_role_and_instruction_kind(tmp_path):
    header = ["Address", "Source", NCU.SAMPLES, NCU.EXECUTED, *NCU.WAVEFRONTS]
    rows = [("0x100", "LDGSTS.E.BYPASS.128 [R9+0x22000], desc[UR4][R18.64]", 1, 4, "8", "4"),
            ("0x110", "USETMAXREG.DEALLOC.CTAPOOL 0x40", 0, 4, "0", "0"),
            ("0x120", "LDS R2, [R27+-0x6000]", 5, 4, "1,000", "0"),
            ("0x130", "@!P6 LDS R3, [R27+-0x5f00]", 5, 4, "24", "-"),
            ("0x140", "USETMAXREG.TRY_ALLOC.CTAPOOL UP0, 0xd8", 0, 4, "0", "0"),
            ("0x150", "HGMMA.64x48x16.F32.BF16 R184, gdesc[UR28].tnspA.tnspB, R184", 9, 4, "28", "0"),
            ("0x160", "STS [R20+0x40], R3", 2, 4, "6", "2"),
            ("0x170", "FMUL R3, R4, R184", 2, 4, "0", "0")]
    lines = ['"Kernel Name","k",', ",".join(f'"{c}"' for c in header)]
    lines += [",".join(f'"{c}"' for c in r) for r in rows]
    path = tmp_path / "sass.csv.gz"
    with gzip.open(path, "wt") as f:
        f.write("\n".join(lines) + "\n")
    roles = NCU.smem_wavefronts(str(path))
    assert [kinds for _, kinds in roles] == [{"LDGSTS": [8, 4]}, {"LDS": [1024, 0]},
                                             {"HGMMA": [28, 0], "STS": [6, 2]}]
    out = NCU.smem_report(str(path))
    assert "shared-memory wavefronts: 0.0 M" in out and "LDS" in out and "FMUL" not in out
