from __future__ import annotations

import pytest

from pdserve.kvstore.block_key import KVLayout, block_keys, next_key, root_key

LAYOUT = KVLayout(dtype="float32", block_size=4, num_layers=2, num_kv_heads=2, head_dim=8)


def test_only_full_blocks_get_keys_and_chain_resumes() -> None:
    root = root_key("m", LAYOUT)
    tokens = list(range(10))
    keys = block_keys(tokens, 4, root)
    assert len(keys) == 2
    assert keys[0] == next_key(root, [0, 1, 2, 3])
    assert keys[1] == next_key(keys[0], [4, 5, 6, 7])
    assert block_keys(tokens + [10, 11], 4, root, start_key=keys[1], start_block=2) == [
        next_key(keys[1], [8, 9, 10, 11])
    ]


def test_keys_name_the_whole_prefix() -> None:
    root = root_key("m", LAYOUT)
    a = block_keys([1, 2, 3, 4, 5, 6, 7, 8], 4, root)
    b = block_keys([9, 2, 3, 4, 5, 6, 7, 8], 4, root)
    assert a[1] != b[1]  # same second block, different first block


def test_model_layout_and_salt_separate_chains() -> None:
    tokens = list(range(8))
    base = block_keys(tokens, 4, root_key("m", LAYOUT))
    assert block_keys(tokens, 4, root_key("other", LAYOUT)) != base
    bf16 = KVLayout("bfloat16", 4, 2, 2, 8)
    assert block_keys(tokens, 4, root_key("m", bf16)) != base
    assert block_keys(tokens, 4, root_key("m", LAYOUT, cache_salt="tenant-a")) != base
    assert block_keys(tokens, 4, root_key("m", LAYOUT, cache_salt=None)) == base


def test_layout_is_validated() -> None:
    with pytest.raises(ValueError):
        KVLayout("float32", 0, 2, 2, 8)
    with pytest.raises(ValueError):
        KVLayout("float32", 16, 2, 2, 8, kind="paged")
    with pytest.raises(ValueError, match="one latent row"):
        KVLayout("float32", 16, 2, 2, 8, kind="mla")


def test_mha_and_mla_layouts_shape_blocks_and_split_heads() -> None:
    mha = KVLayout("float32", 16, 3, 4, 8)
    assert mha.num_planes == 2 and mha.block_shape() == (3, 2, 16, 4, 8)
    assert mha.rank_heads(1, 2) == slice(2, 4)
    with pytest.raises(ValueError, match="do not split"):
        mha.rank_heads(0, 3)
    mla = KVLayout("float32", 16, 3, 1, 576, kind="mla")
    assert mla.num_planes == 1 and mla.block_shape() == (3, 1, 16, 1, 576)
    assert mla.rank_heads(1, 4) == slice(0, 1)  # the latent is whole on every rank
    tokens = list(range(16))
    mha_576 = KVLayout("float32", 16, 3, 1, 576)
    assert block_keys(tokens, 16, root_key("m", mla)) != block_keys(tokens, 16,
                                                                     root_key("m", mha_576))
