"""Image-and-text conversations (toolkit/data/vision.py): the formats read alike, each refusal is one line, and
the collator's labels hold the assistant's tokens and nothing else under each family's processor, whose expansion
of an image differs (Gemma 3: newlines around a run of soft tokens; Idefics3: a grid of tiles; LLaVA: a run)."""

from __future__ import annotations

import io

import pytest
import torch
from vision_processors import PROCESSORS, picture, trained_text

from toolkit.data.conversations import IGNORE_INDEX
from toolkit.data.vision import VisionCollator, open_image, vision_conversation
from toolkit.errors import DataError

TWO_TURNS = [
    {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour is the square?"}]},
    {"role": "assistant", "content": [{"type": "text", "text": "It is red."}]},
    {"role": "user", "content": [{"type": "text", "text": "And the circle?"}, {"type": "image"}]},
    {"role": "assistant", "content": [{"type": "text", "text": "Blue, on a green ground."}]},
]
# What each family's template makes the model write after its generation prompt: the answers and turn endings.
TRAINED = {
    "gemma3": "It is red.<end_of_turn>\nBlue, on a green ground.<end_of_turn>\n",
    "idefics3": " It is red.<end_of_utterance>\n Blue, on a green ground.<end_of_utterance>\n",  # "Assistant:" + " It"
    "llava": " It is red.</s> Blue, on a green ground.</s>",  # "ASSISTANT: It": the header's space joins "It"
    "qwen2_vl": "It is red.<|im_end|>\nBlue, on a green ground.<|im_end|>\n",
    "qwen2_5_vl": "It is red.<|im_end|>\nBlue, on a green ground.<|im_end|>\n",
    "qwen3_vl": "It is red.<|im_end|>\nBlue, on a green ground.<|im_end|>\n",
    "llava_onevision": "It is red.<|im_end|>\nBlue, on a green ground.<|im_end|>\n",
    "internvl": "It is red.<|im_end|>\nBlue, on a green ground.<|im_end|>\n",
}


def image_token_ids(processor) -> set[int]:
    """The ids a processor writes for an image (its placeholder, tiles and wrappers): the added special tokens but
    the turn markers."""
    added = processor.tokenizer.get_added_vocab()
    turns = ("<end_of_turn>", "<start_of_turn>", "<end_of_utterance>", "<|im_start|>", "<|im_end|>", "</s>")
    return {i for token, i in added.items() if token.startswith("<") and token not in turns and "text" not in token}


@pytest.mark.parametrize("family", sorted(PROCESSORS))
def test_labels_are_the_assistants_tokens_and_never_an_images(family):
    processor = PROCESSORS[family]()
    collate = VisionCollator(processor, max_length=4096)
    rows = [(TWO_TURNS, [picture(0), picture(1)]), (TWO_TURNS[:2], [picture(2)])]
    batch = collate(rows)
    assert trained_text(processor.tokenizer, batch, 0) == TRAINED[family]
    assert TRAINED[family].startswith(trained_text(processor.tokenizer, batch, 1))
    images = torch.isin(batch["input_ids"], torch.tensor(sorted(image_token_ids(processor))))
    assert images.sum() >= 3 * 4  # three images' tokens are in the batch, and none of them carries a label
    assert (batch["labels"][images] == IGNORE_INDEX).all()
    assert (batch["labels"][batch["attention_mask"] == 0] == IGNORE_INDEX).all()  # nor does padding
    alone = collate(rows[1:])  # a row's labels do not depend on the rows beside it
    width = alone["input_ids"].shape[1]
    assert torch.equal(alone["labels"][0], batch["labels"][1, :width])


@pytest.mark.parametrize("family", ["gemma3", "idefics3"])
def test_a_long_row_is_cut_after_its_images_never_through_one(family):
    processor = PROCESSORS[family]()
    rows = [(TWO_TURNS[:2], [picture(0)])]
    full = VisionCollator(processor, max_length=4096)(rows)
    length = full["input_ids"].shape[1]
    cut = VisionCollator(processor, max_length=length - 3)(rows)
    assert torch.equal(cut["input_ids"], full["input_ids"][:, : length - 3])
    assert torch.equal(cut["pixel_values"], full["pixel_values"])
    with pytest.raises(DataError, match=r"the cut would split an image: raise --max_seq_length"):
        VisionCollator(processor, max_length=6)(rows)


def test_llava_rows_and_messages_rows_give_the_same_batch(tmp_path):
    picture(0).save(tmp_path / "a.png")
    llava = {"conversations": [{"from": "human", "value": "<image>\nWhat colour is the square?"},
                               {"from": "gpt", "value": "It is red."}], "image": "a.png"}  # fmt: skip
    messages = {"messages": TWO_TURNS[:2], "images": [(tmp_path / "a.png").read_bytes()]}
    inline = {"messages": [{"role": "user", "content": [{"type": "image", "image": str(tmp_path / "a.png")},
                                                         {"type": "text", "text": "What colour is the square?"}]},
                           {"role": "assistant", "content": "It is red."}]}  # fmt: skip
    read = [vision_conversation(row, root=tmp_path) for row in (llava, messages, inline)]
    assert read[0][0] == read[1][0] == read[2][0] == TWO_TURNS[:2]
    collate = VisionCollator(PROCESSORS["gemma3"](), max_length=4096)
    batches = [collate([row]) for row in read]
    for batch in batches[1:]:
        assert all(torch.equal(batch[k], batches[0][k]) for k in batches[0])


def test_an_image_reads_the_same_from_a_path_bytes_a_datasets_value_or_pil(tmp_path):
    picture(3).save(tmp_path / "b.png")
    data = (tmp_path / "b.png").read_bytes()
    values = ["b.png", data, {"bytes": data, "path": None}, {"bytes": None, "path": str(tmp_path / "b.png")},
              open_image(io.BytesIO(data).getvalue())]  # fmt: skip
    pixels = [open_image(v, root=tmp_path).tobytes() for v in values]
    assert all(p == pixels[0] for p in pixels)


@pytest.mark.parametrize("row, message", [
    ({"messages": TWO_TURNS[:2], "images": []}, r"1 image placeholder\(s\) and 0 image\(s\): a row without its image"),
    ({"messages": TWO_TURNS[:2], "images": [b"", b""]},
     r'2 image\(s\) and 1 placeholder\(s\): mark where each image goes with an \{"type": "image"\} part'),
    ({"conversations": [{"from": "human", "value": "What is it?"}, {"from": "gpt", "value": "A cat."}],
      "image": "x.png"},
     r"1 image\(s\) and 0 placeholder\(s\): mark where each image goes with a <image> in its text"),
    ({"messages": TWO_TURNS[:2], "images": [b"not an image"]}, r"its image does not decode"),
    ({"messages": TWO_TURNS[:2], "images": ["missing.png"]}, r"its image missing.png is not a file"),
    ({"messages": [TWO_TURNS[0], {"role": "assistant", "content": [{"type": "image"}]}], "images": [b"", b""]},
     r"an assistant turn holds an image"),
])  # fmt: skip
def test_a_row_that_cannot_train_is_one_line_saying_why(row, message, tmp_path):
    with pytest.raises(DataError, match=message) as refused:
        vision_conversation(row, root=tmp_path)
    assert "\n" not in str(refused.value)


@pytest.mark.parametrize("family", sorted(PROCESSORS))
def test_the_batch_trains_the_familys_own_model_on_the_answers_and_the_image(family):
    """The collator's batch is what the family's model takes: its loss is the cross-entropy of the next token at
    the labelled positions (computed here from the logits), and the image reaches it (the vision tower gets
    gradients; another image, another loss)."""
    from vision_processors import tiny_model

    torch.manual_seed(0)
    processor = PROCESSORS[family]()
    model = tiny_model(family, processor)
    collate = VisionCollator(processor, max_length=4096)
    batch = collate([(TWO_TURNS, [picture(0), picture(1)])])
    out = model(**batch)
    logits, labels = out.logits[0, :-1].float(), batch["labels"][0, 1:]
    kept = labels != IGNORE_INDEX
    expected = torch.nn.functional.cross_entropy(logits[kept], labels[kept])
    assert torch.allclose(out.loss, expected, rtol=1e-5)
    out.loss.backward()
    tower = [p for name, p in model.named_parameters() if "vision" in name or "visual" in name]
    assert tower and any(p.grad is not None and p.grad.abs().sum() > 0 for p in tower)
    other = collate([(TWO_TURNS, [picture(5), picture(6)])])
    assert torch.equal(other["input_ids"], batch["input_ids"])
    with torch.no_grad():
        assert not torch.allclose(model(**other).loss, out.loss)


@pytest.mark.parametrize("family", ["gemma3", "qwen2_vl"])
def test_rows_an_image_cut_would_split_are_counted_and_left_out(family):
    """The pre-pass keeps a row whose cut falls after its images and leaves out (and counts) one whose image the
    cut would split, each kept row with its length (capped at the cut); the kept rows then collate without a
    refusal."""
    from datasets import Dataset

    from toolkit.data.image_rows import measured
    from toolkit.data.length_grouping import LENGTH
    from toolkit.data.vision import extents

    processor = PROCESSORS[family]()
    early = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour is the square?"}]},
             {"role": "assistant", "content": [{"type": "text", "text": "It is red. " * 8}]}]  # fmt: skip
    late = [{"role": "user", "content": [{"type": "text", "text": "Describe the picture. " * 8}, {"type": "image"}]},
            {"role": "assistant", "content": [{"type": "text", "text": "It is red."}]}]  # fmt: skip
    rows = [(early, [picture(0)]), (late, [picture(1)]), (TWO_TURNS[:2], [picture(2)])]
    (end, full), (late_end, _), _ = extents(VisionCollator(processor, 4096), rows)
    assert end < late_end and end < full == VisionCollator(processor, 4096)(rows[:1])["input_ids"].shape[1]
    collate = VisionCollator(processor, max_length=(end + late_end) // 2)
    split = Dataset.from_list([{"messages": messages, "images": images} for messages, images in rows])
    kept, dropped = measured(split, collate, "train")
    assert dropped == 1 and len(kept) == 2 and kept[0][LENGTH] == collate.max_length
    batch = collate([kept[0], kept[1]])  # rows as the data set holds them
    assert batch["input_ids"].shape[1] == collate.max_length
    with pytest.raises(DataError, match="the cut would split an image"):
        collate([rows[1]])


def test_image_max_pixels_scales_each_image_down_before_the_processor():
    """--image_max_pixels: an image above it reaches the processor scaled down, its aspect kept; one within it,
    untouched. LLaVA-OneVision picks its AnyRes grid by the image's size: a 56-pixel picture is its base view's 4
    tokens and 2 x 2 tiles' 4 x 4 patches with a newline a row (24), at 28 x 28 pixels one tile's 2 x 2 (10)."""
    from toolkit.data.vision import within

    processor = PROCESSORS["llava_onevision"]()
    rows = [(TWO_TURNS[:2], [picture(0, (56, 56))])]
    image_tokens = processor.tokenizer.image_token_id

    def tokens(collator) -> int:
        return int((collator(rows)["input_ids"] == image_tokens).sum())

    assert (tokens(VisionCollator(processor, 4096)), tokens(VisionCollator(processor, 4096, 28 * 28))) == (24, 10)
    wide = within(picture(1, (56, 84)), 28 * 28)  # 84 x 56 pixels, 3:2
    assert wide.size[0] * wide.size[1] <= 28 * 28 and wide.size[0] / wide.size[1] == pytest.approx(1.5, rel=0.05)
    small = picture(2, (20, 20))
    assert within(small, 28 * 28) is small and within(picture(0, (56, 56)), None).size == (56, 56)


def test_generate_scales_a_picture_as_the_run_trained(tmp_path):
    """`toolkit generate RUN --image` sends the picture at the run's --image_max_pixels (read from its
    run_summary.json, beside the model or a folder up), as its training pictures were: 24 image tokens unscaled,
    10 at 28 x 28 pixels (LLaVA-OneVision, above). It had been sent as it was."""
    import json

    from toolkit.data.vision import prompt_batch
    from toolkit.generate import trained_max_pixels

    processor = PROCESSORS["llava_onevision"]()
    path = tmp_path / "picture.png"
    picture(0, (56, 56)).save(path)
    messages = [{"role": "user", "content": "What colour is it?"}]
    for max_pixels, count in [(None, 24), (28 * 28, 10)]:
        batch, _ = prompt_batch(processor, messages, path, max_pixels)
        assert int((batch["input_ids"] == processor.tokenizer.image_token_id).sum()) == count
    (tmp_path / "run" / "checkpoint-2").mkdir(parents=True)
    summary = {"summary": {}, "config": {"toolkit": {"image_max_pixels": 784}}}
    (tmp_path / "run" / "run_summary.json").write_text(json.dumps(summary))
    assert trained_max_pixels(tmp_path / "run") == trained_max_pixels(tmp_path / "run" / "checkpoint-2") == 784
    assert trained_max_pixels(tmp_path) is None
