"""Each knob is declared once (knobs.py); the settings object, llm's Options, `llm mlxs
config` and the server's request fields are derived from that one declaration."""

from __future__ import annotations

import llm
import pytest
from pydantic import ValidationError

from llm_mlx_streaming.options.knobs import BY_NAME, KNOBS, OPTION_NAMES, SETTING_NAMES
from llm_mlx_streaming.options.settings import Options
from llm_mlx_streaming.server.fields import SERVER_ONLY, engine_option_names
from llm_mlx_streaming.server.openai.schemas import ChatCompletionRequest
from llm_mlx_streaming.options.settings import CONFIG_KEYS, Settings


def test_settings_options_and_request_fields_come_from_the_declarations():
    assert len(BY_NAME) == len(KNOBS)  # a name is declared once
    assert tuple(Settings.model_fields) == SETTING_NAMES + ("models",)
    assert CONFIG_KEYS == SETTING_NAMES
    assert tuple(n for n in Options.model_fields if n not in llm.Options.model_fields) == OPTION_NAMES
    assert engine_option_names() == [n for n in OPTION_NAMES if n not in SERVER_ONLY]
    assert set(engine_option_names()) <= set(ChatCompletionRequest.model_fields)
    for name in set(SETTING_NAMES) & set(OPTION_NAMES):
        setting, option = Settings.model_fields[name], Options.model_fields[name]
        assert option.description.startswith(setting.description) and option.default is None
        assert option.metadata == setting.metadata, name  # the same bounds


@pytest.mark.parametrize("name, value", [
    ("kv_bits", "5"), ("kv_group_size", "48"), ("k", "two"), ("k", 100), ("draft", ""), ("prefill_step", 3),
    ("memory_budget", "lots"), ("max_tokens", -2), ("expert_slots", 0), ("policy", "fifo"), ("kv_start", -1),
])
def test_a_value_refused_as_a_setting_is_refused_as_an_option_for_the_same_reason(name, value):
    with pytest.raises(ValidationError) as as_setting:
        Settings(**{name: value})
    with pytest.raises(ValidationError) as as_option:
        Options(**{name: value})
    assert as_setting.value.errors()[0]["msg"] == as_option.value.errors()[0]["msg"]


def test_options_left_out_are_none_and_settings_have_their_defaults():
    options, settings = Options(), Settings()
    for knob in KNOBS:
        if knob.option:
            assert getattr(options, knob.name) is None
        if knob.setting:
            assert getattr(settings, knob.name) == knob.default


SIZES = {"memory_budget": "GB", "buffer_cache": "GB", "snapshot_memory": "GB", "conversation_cache_size": "GB",
         "max_image_bytes": "MB"}  # every size knob, and the unit a bare number of it likely meant


def test_every_size_knob_refuses_a_number_without_a_unit_naming_the_unit_meant():
    from llm_mlx_streaming import values

    sizes = {values.budget, values.buffer_size, values.snapshot_size, values.disk_size, values.byte_count}
    assert {k.name for k in KNOBS if k.check in sizes} == set(SIZES)  # a new size knob is listed here
    for name, unit in SIZES.items():
        for model in (Settings, Options) if BY_NAME[name].option else (Settings,):
            with pytest.raises(ValidationError, match=rf"12: did you mean 12{unit}\? Bytes are written 12B"):
                model(**{name: "12"})
            assert getattr(model(**{name: f"12{unit}"}), name) in (f"12{unit}", 12 * 1000**(3 if unit == "GB" else 2))
            model(**{name: "12MiB"})  # a unit, or a number of bytes that is a plausible size, is taken
            model(**{name: "2000000"})
            model(**{name: 4096})  # an int: a JSON number, or a byte count the settings file keeps
