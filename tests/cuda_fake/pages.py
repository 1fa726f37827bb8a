"""What the fake driver has mapped under a CUDA range, page by page, and the invariant it obeys.

The backend's own bookkeeping is not trusted here: every state is read back from the fake.
"""

from __future__ import annotations

from fakecuda_lib import ACCESS_READ, ACCESS_READWRITE, FakeCuda

from elastickv.vmm.cuda import CudaRange


def zero_handle(fake: FakeCuda, vrange: CudaRange) -> int | None:
    """The zero page's handle: what is mapped at the window just past the range."""
    window = fake.mapping_at(vrange.base_address + vrange.size_bytes)
    return None if window is None else window[0]


def page_states(fake: FakeCuda, vrange: CudaRange) -> list[str]:
    """Per page: ``real`` (its own handle, read-write), ``zero-r`` / ``zero-rw`` (the zero page,
    read-only / read-write), ``none`` (unmapped), or what else the driver holds there."""
    zero = zero_handle(fake, vrange)
    states = []
    for page in range(vrange.num_pages):
        mapping = fake.mapping_at(vrange.base_address + page * vrange.page_size)
        if mapping is None:
            states.append("none")
            continue
        handle, access = mapping
        kind = "zero" if handle == zero else "real"
        if (kind, access) == ("real", ACCESS_READWRITE):
            states.append("real")
        elif kind == "zero" and access in (ACCESS_READ, ACCESS_READWRITE):
            states.append("zero-r" if access == ACCESS_READ else "zero-rw")
        else:
            states.append(f"{kind}-access-{access}")
    return states


def uncommitted_state(vrange: CudaRange) -> str:
    """What every uncommitted page must be in this range's mode."""
    if vrange.uncommitted == "fault":
        return "none"
    return "zero-r" if vrange.zero_page_read_only else "zero-rw"


def assert_consistent(fake: FakeCuda, vrange: CudaRange) -> None:
    """Committed pages map their own handles read-write (never shared); every other page maps
    the zero page with the mode's access (zero mode) or nothing (fault mode); the zero page is
    mapped exactly there and at its window; the driver's memory is what the range says it holds,
    and the footprint counts committed pages only."""
    committed = vrange.committed_pages()
    idle = uncommitted_state(vrange)
    states = page_states(fake, vrange)
    expected = ["real" if page in committed else idle for page in range(vrange.num_pages)]
    assert states == expected
    handles = []
    for page in sorted(committed):
        mapping = fake.mapping_at(vrange.base_address + page * vrange.page_size)
        assert mapping is not None
        handles.append(mapping[0])
    assert len(set(handles)) == len(handles), "two committed pages share a physical page"
    zero = zero_handle(fake, vrange)
    if vrange.uncommitted == "zero":
        assert zero is not None
        assert fake.handle_mappings(zero) == vrange.num_pages - len(committed) + 1
    else:
        assert zero is None
    assert vrange.footprint_bytes() == len(committed) * vrange.page_size
    assert fake.used_bytes() == vrange.held_bytes()
