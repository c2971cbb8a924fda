"""CPU weights in transparent huge pages (orca_ext/models/huge_pages.py and the loader's use of it):
the copies hold the same values in the promised layout, outlive their sources, are really backed
by huge pages where the system offers them, and a model loaded that way computes the same logits
bit for bit."""
from __future__ import annotations

import gc
import re
from pathlib import Path

import pytest
import torch

from orca_ext import modes
from orca_ext.models import ForwardBatch, huge_pages, load_model

pytestmark = pytest.mark.skipif(not huge_pages.supported(), reason="huge pages are advised on Linux only")

MIB = 1 << 20


@pytest.fixture(autouse=True)
def huge_pages_mode_on():
    """The huge_pages kernel mode on, whatever an earlier test of the process left."""
    with modes.using(huge_pages=True):
        yield


def thp_mode() -> str:
    """The bracketed choice of /sys/kernel/mm/transparent_hugepage/enabled ('' if unreadable)."""
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return ""
    m = re.search(r"\[(\w+)\]", text)
    return m.group(1) if m else ""


def huge_kib_of_mapping(address: int) -> int:
    """AnonHugePages (KiB) of the mapping of this process that contains `address`."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line)
        if head:
            inside = int(head.group(1), 16) <= address < int(head.group(2), 16)
        elif inside and line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    raise AssertionError(f"no mapping contains {address:#x}")


def test_place_all_copies_values_into_one_aligned_region():
    gen = torch.Generator().manual_seed(1)
    sources = [torch.randn(517, 1031, generator=gen),                   # 2.03 MiB, odd shape
               None,
               torch.randn(13, generator=gen).bfloat16(),               # 26 bytes: the next starts padded
               torch.randint(-9, 9, (3, 5, 7), generator=gen, dtype=torch.int64),
               torch.randn(129, 33, generator=gen).bfloat16()]
    expected = [None if t is None else t.clone() for t in sources]
    placed = huge_pages.place_all(sources)
    del sources
    gc.collect()  # the copies must not depend on the source tensors
    assert placed[1] is None
    tensors = [t for t in placed if t is not None]
    assert tensors[0].data_ptr() % huge_pages.HUGE_PAGE_BYTES == 0
    storage = tensors[0].untyped_storage().data_ptr()
    for got, want in zip(placed, expected):
        if want is None:
            continue
        assert got.dtype == want.dtype and got.shape == want.shape and got.is_contiguous()
        assert torch.equal(got, want)
        assert got.data_ptr() % 64 == 0
        assert got.untyped_storage().data_ptr() == storage  # one region for all of them
    ends = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in tensors)
    assert all(end <= start for (_, end), (start, _) in zip(ends, ends[1:])), "copies overlap"


def test_small_or_foreign_tensors_stay_where_they_are():
    small = [torch.randn(100, 100), torch.randn(7)]  # 40 KB together: less than one huge page
    assert all(a is b for a, b in zip(huge_pages.place_all(small), small))
    big_meta = torch.empty(4096, 4096, device="meta")
    assert huge_pages.place(big_meta) is big_meta
    assert huge_pages.place_all([None, None]) == [None, None]


@pytest.mark.skipif(thp_mode() not in ("always", "madvise"), reason="transparent huge pages are off")
def test_the_kernel_backs_placed_memory_with_huge_pages():
    t = huge_pages.place(torch.ones(8 * MIB // 4))  # 8 MiB, every page written by the copy
    assert huge_kib_of_mapping(t.data_ptr()) >= 2048, "not even one huge page backs the copy"
    assert float(t.sum()) == t.numel()


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_loader_packs_each_layer_and_the_logits_do_not_change(tiny_model_dir, family, dtype):
    # Wide enough that a layer's matrices outgrow one huge page in both dtypes.
    path = tiny_model_dir(family, hidden_size=384, intermediate_size=1536, num_attention_heads=8,
                          num_key_value_heads=2)
    with modes.using(huge_pages=False):
        assert not huge_pages.active()
        plain = load_model(path, dtype=dtype)
    with modes.using(huge_pages=True):
        assert huge_pages.active()
        packed = load_model(path, dtype=dtype)
    for layer in plain.layers:  # torch's own allocation: one storage per tensor
        tensors = [t for t in vars(layer).values() if t is not None]
        assert len({t.untyped_storage().data_ptr() for t in tensors}) == len(tensors)
    for layer, ref in zip(packed.layers, plain.layers):
        tensors = [t for t in vars(layer).values() if t is not None]
        storages = {t.untyped_storage().data_ptr() for t in tensors}
        assert len(storages) == 1, "a layer's tensors are not in one region"
        assert min(t.data_ptr() for t in tensors) % huge_pages.HUGE_PAGE_BYTES == 0
        for name, t in vars(layer).items():
            other = getattr(ref, name)
            assert (t is None) == (other is None) and (t is None or torch.equal(t, other)), name
    batch = ForwardBatch.build([([5, 17, 3, 99, 42], 0, 0), ([7, 7, 1], 0, 64)])
    logits = []
    for model in (plain, packed):
        model.allocate_kv_cache(128)
        logits.append(model.forward(batch))
    assert torch.equal(logits[0], logits[1])


def test_kv_pools_are_zeroed_huge_page_views(tiny_model_dir):
    model = load_model(tiny_model_dir("llama"), dtype=torch.float32)
    with modes.using(huge_pages=True):
        k_cache, v_cache = model.allocate_kv_cache(3000)
    assert model.kv_pools.data_ptr() % huge_pages.HUGE_PAGE_BYTES == 0
    assert not model.kv_pools.any()
    assert all(k.data_ptr() == model.kv_pools[i].data_ptr() for i, k in enumerate(k_cache))
    assert all(v.data_ptr() == model.kv_pools[len(k_cache) + i].data_ptr() for i, v in enumerate(v_cache))
    with modes.using(huge_pages=False):
        model.allocate_kv_cache(3000)  # torch's own allocation
    assert not model.kv_pools.any() and model.kv_pools.shape[1] == 3000
