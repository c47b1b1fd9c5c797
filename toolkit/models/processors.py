"""An image-text model's processor: its image processor, tokenizer and chat template, as AutoProcessor loads them;
for images alone where the model's video processor cannot load.

transformers 5 builds several families' processors (the Qwen2-VL family's, LLaVA-OneVision's, InternVL's) only
with their video processor, which needs torchvision; a CPU build of torch has none beside it. Image-text training
never calls the video processor, so where it is what fails, the processor is built from its image processor (the
PIL one, which needs no torchvision) and tokenizer, as its own class less that attribute: the run trains, saves
and reloads it the same way, and the log says so.
"""

from __future__ import annotations

import json
import logging

from ..errors import ConfigError, first_line

log = logging.getLogger(__name__)
TORCHVISION = ("pip install torchvision, the build that matches your torch (for a CPU torch, from "
               "https://download.pytorch.org/whl/cpu)")  # fmt: skip


def load_processor(name: str, trust_remote_code: bool = False):
    """The model's own processor (AutoProcessor), or its images-only form where only its video processor fails to
    load. One line for any other part that needs torchvision where it is missing, and for a model that has no
    image processor."""
    from transformers import AutoProcessor

    def lacking(why: str) -> str:
        return (f"{name} has no image processor ({why}): it is not an image-text model, or its folder lacks "
                "preprocessor_config.json: save it with processor.save_pretrained(folder).")  # fmt: skip

    try:
        processor = AutoProcessor.from_pretrained(name, trust_remote_code=trust_remote_code)
    except OSError as error:  # a processor class named, its image (or video) processor's files absent
        if "video processor" in str(error):
            return images_only(name, trust_remote_code, "no video_preprocessor_config.json")
        if "image processor" not in str(error):
            raise
        raise ConfigError(lacking("transformers found no preprocessor_config.json")) from None
    except ImportError as error:
        if "torchvision" not in str(error).lower():
            raise
        if "VideoProcessor" in str(error):
            return images_only(name, trust_remote_code, f"{first_line(error).split(' requires')[0]} needs torchvision")
        raise ConfigError(f"{name}'s processor needs torchvision ({first_line(error).split(' requires')[0]} "
                          f"requires it): {TORCHVISION}.") from None  # fmt: skip
    if getattr(processor, "image_processor", None) is None:
        raise ConfigError(lacking(f"AutoProcessor gave a {type(processor).__name__}"))
    return processor


def images_only(name: str, trust_remote_code: bool, why: str):
    """`name`'s processor class without its video processor: its image processor and tokenizer, its chat template.
    Saved, it names its own class, and loads this way again."""
    from transformers import AutoImageProcessor, AutoTokenizer
    from transformers.models.auto.processing_auto import processor_class_from_name

    own = _json(name, "processor_config.json")
    found = processor_class_from_name(_processor_class(name, own) or "")
    if found is None or "video_processor" not in found.get_attributes():
        raise ConfigError(f"{name}'s processor cannot load ({why}): {TORCHVISION}.")
    images = images_only_class(found)
    tokenizer = AutoTokenizer.from_pretrained(name, trust_remote_code=trust_remote_code)
    pixels = AutoImageProcessor.from_pretrained(name, trust_remote_code=trust_remote_code)
    # its chat template: its own file, else processor_config.json's, else the tokenizer's
    template = _read(name, "chat_template.jinja") or own.get("chat_template") or tokenizer.chat_template
    log.warning("%s: images only (its video processor cannot load: %s)", name, why)
    return images(image_processor=pixels, tokenizer=tokenizer, chat_template=template, **_settings(own, found))


def _settings(own: dict, found: type) -> dict:
    """The processor's own settings its processor_config.json keeps (LLaVA-OneVision's num_image_tokens, ...):
    those its class takes, the parts' own configs and the template left out."""
    import inspect

    taken = inspect.signature(found.__init__).parameters
    parts = {"image_processor", "video_processor", "tokenizer", "chat_template", "processor_class"}
    return {k: v for k, v in own.items() if k in taken and k not in parts}


def images_only_class(found: type) -> type:
    """A processor class less its video processor, under the class's own name (what save_pretrained writes)."""
    attributes = [a for a in found.get_attributes() if a != "video_processor"]
    return type(found.__name__, (found,), {"get_attributes": classmethod(lambda cls: attributes)})


def _read(name: str, filename: str) -> str | None:
    from transformers.utils import cached_file

    path = cached_file(name, filename, _raise_exceptions_for_missing_entries=False)
    return open(path, encoding="utf-8").read() if path else None


def _json(name: str, filename: str) -> dict:
    text = _read(name, filename)
    return json.loads(text) if text else {}


def _processor_class(name: str, own: dict) -> str | None:
    """The processor class a model's files name (its processor_config.json, `own`, else its image processor's or
    tokenizer's config), as AutoProcessor reads it."""
    if own.get("processor_class"):
        return own["processor_class"]
    for filename in ("preprocessor_config.json", "tokenizer_config.json"):
        if found := _json(name, filename).get("processor_class"):
            return found
    return None
