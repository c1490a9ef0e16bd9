"""SpeculativeConfig: vLLM's JSON accepted, bad values a ValueError naming the field."""

from __future__ import annotations

import pytest

from iterserve.config_speculative import SpeculativeConfig, parse_speculative_config


def test_parse_vllm_json():
    cfg = parse_speculative_config(
        '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, '
        '"prompt_lookup_max": 5}')
    assert cfg == SpeculativeConfig("ngram", 4, 2, 5)
    assert parse_speculative_config(None) is None
    assert parse_speculative_config("none") is None
    assert parse_speculative_config(cfg) is cfg


def test_defaults_follow_vllm():
    cfg = parse_speculative_config({"method": "ngram", "num_speculative_tokens": 3})
    assert cfg is not None and (cfg.prompt_lookup_min, cfg.prompt_lookup_max) == (5, 5)
    cfg = parse_speculative_config({"method": "ngram", "num_speculative_tokens": 3,
                                    "prompt_lookup_max": 4})
    assert cfg is not None and (cfg.prompt_lookup_min, cfg.prompt_lookup_max) == (4, 4)
    # vLLM's older shorthand, and a bare model meaning a draft model.
    cfg = parse_speculative_config({"model": "ngram", "num_speculative_tokens": 2})
    assert cfg is not None and cfg.method == "ngram" and cfg.model is None
    cfg = parse_speculative_config({"model": "/m", "num_speculative_tokens": 2})
    assert cfg is not None and cfg.method == "draft_model"
    cfg = parse_speculative_config({"method": "suffix"})
    assert cfg is not None and cfg.num_speculative_tokens == cfg.suffix_decoding_max_tree_depth


@pytest.mark.parametrize(
    "value, field",
    [
        ('{"method": "medusa", "num_speculative_tokens": 2}', "method"),
        ('{"method": "ngram"}', "num_speculative_tokens"),
        ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens"),
        ('{"method": "ngram", "num_speculative_tokens": true}', "num_speculative_tokens"),
        ('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0}',
         "prompt_lookup_min"),
        ('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, '
         '"prompt_lookup_max": 2}', "prompt_lookup_min"),
        ('{"method": "draft_model", "num_speculative_tokens": 2}', "model"),
        ('{"method": "ngram", "num_speculative_tokens": 2, "bogus": 1}', "bogus"),
        ('{"num_speculative_tokens": 2}', "method"),
        ('{"method": "ngram", "num_speculative_tokens": 2, "acceptance_ewma_alpha": 2}',
         "acceptance_ewma_alpha"),
        ('{"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 0}',
         "disable_by_batch_size"),
        ('{"method": "suffix", "suffix_decoding_min_token_prob": 1.5}',
         "suffix_decoding_min_token_prob"),
        ('{"method": "ngram", ', "JSON"),
        ('[1, 2]', "JSON object"),
    ],
)
def test_bad_values_name_the_field(value, field):
    with pytest.raises(ValueError, match=field):
        parse_speculative_config(value)


def test_engine_args_record_the_config_as_json():
    import json

    from iterserve.engine.builder import engine_config_from_args
    from iterserve.entrypoints.engine_args import engine_args_dict

    cfg = engine_config_from_args(None, speculative_config='{"method": "ngram", '
                                  '"num_speculative_tokens": 3}')
    assert cfg.speculative_config == SpeculativeConfig("ngram", 3)
    rec = json.loads(json.dumps(engine_args_dict(cfg)))["speculative_config"]
    assert parse_speculative_config(rec) == cfg.speculative_config
    assert engine_args_dict(engine_config_from_args(None))["speculative_config"] is None
