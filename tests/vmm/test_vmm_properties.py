"""Property test: any sequence of commit/release keeps bookkeeping, kernel footprint and data
in line with a plain set model."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from elastickv.vmm import HostBackend

PAGES = 12

operations = st.lists(
    st.tuples(
        st.sampled_from(["commit", "release"]),
        st.sets(st.integers(min_value=0, max_value=PAGES - 1), max_size=PAGES),
    ),
    max_size=25,
)


@settings(max_examples=60, deadline=None)
@given(ops=operations)
def test_commit_release_sequences_match_a_set_model(ops: list[tuple[str, set[int]]]) -> None:
    backend = HostBackend()
    page = backend.page_size
    model: dict[int, int] = {}
    with backend.reserve(PAGES * page) as vrange:
        tensor = vrange.as_tensor()
        for step, (op, pages) in enumerate(ops, start=1):
            if op == "commit":
                fresh = pages - model.keys()
                assert vrange.commit(pages) == len(fresh)
                for p in sorted(fresh):
                    assert int(tensor[p * page]) == 0, "a newly committed page reads zeros"
                    tensor[p * page] = step
                    model[p] = step
            else:
                gone = pages & model.keys()
                assert vrange.release(pages) == len(gone)
                for p in gone:
                    del model[p]
            assert vrange.committed_pages() == model.keys()
            assert vrange.footprint_bytes() == len(model) * page
            for p, tag in model.items():
                assert int(tensor[p * page]) == tag
        assert all(vrange.is_committed(p) == (p in model) for p in range(PAGES))
    assert vrange.footprint_bytes() == 0
