"""PieceReader: any block or flat range of a tensor read back from pieces stored as tensor-parallel blocks, ZeRO
flat ranges of them, or whole -- equal to slicing the tensor itself, and incomplete coverage refused."""

import pytest
import torch

from trickles.errors import CheckpointError
from trickles.train.pieces import PieceReader, save_pieces

FULL = torch.arange(6 * 10, dtype=torch.float32).reshape(6, 10)


def _store(tmp, layout):
    """Pieces of FULL, one file per piece: a 2x2 grid of blocks, each cut into 3 flat ranges; or the whole tensor."""
    if layout == "whole":
        save_pieces({"w": FULL}, f"{tmp}/model-rank00000.safetensors")
        return
    n = 0
    for r in (0, 3):
        for c in (0, 4):
            shape = (3, 4 if c == 0 else 6)
            block = FULL[r : r + 3, c : c + shape[1]]
            meta = {"global_shape": [6, 10], "offset": [r, c], "block_shape": list(shape)}
            if layout == "blocks":
                save_pieces({"w": (block.clone(), meta)}, f"{tmp}/model-rank{n:05d}.safetensors")
                n += 1
                continue
            cuts = [0, 5, 5, block.numel()]  # one of them empty
            for a, b in zip(cuts, cuts[1:]):
                piece = block.reshape(-1)[a:b].clone()
                save_pieces({"w": (piece, {**meta, "flat_range": [a, b]})}, f"{tmp}/model-rank{n:05d}.safetensors")
                n += 1


@pytest.mark.parametrize("layout", ["whole", "blocks", "blocks+flat"])
@pytest.mark.parametrize(
    "offset,shape", [((0, 0), (6, 10)), ((1, 2), (4, 5)), ((2, 3), (1, 1)), ((0, 7), (6, 3)), ((5, 0), (1, 10))]
)
def test_any_block_reads_back_as_the_slice_of_the_whole(tmp_path, layout, offset, shape):
    _store(tmp_path, layout)
    reader = PieceReader(str(tmp_path), "model")
    want = FULL[offset[0] : offset[0] + shape[0], offset[1] : offset[1] + shape[1]]
    assert torch.equal(reader.read("w", (offset, shape)), want)
    assert torch.equal(reader.read("w", (offset, shape), flat_range=(1, want.numel() - 1)), want.reshape(-1)[1:-1])


def test_a_missing_piece_is_refused(tmp_path):
    _store(tmp_path, "blocks+flat")
    (tmp_path / "model-rank00006.safetensors").unlink()  # the first 5 elements of the block at (3, 0)
    reader = PieceReader(str(tmp_path), "model")
    assert torch.equal(reader.read("w", ((0, 0), (3, 10))), FULL[:3])
    assert torch.equal(reader.read("w", ((5, 0), (1, 10))), FULL[5:])
    with pytest.raises(CheckpointError, match="incomplete"):
        reader.read("w")
