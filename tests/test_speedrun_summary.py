"""The speedrun summary table: one row per figure (issue 20: one SFT parse row, not two)."""

from lmforge.stages.speedrun import SFT_EVAL_MAX_NEW_TOKENS, sft_rows


def _summary():
    return {"sft_val_loss": 3.74, "sft_steps": 150,
            "sft_data": {"train": {"kept": 2000, "truncated": 3, "dropped_all_cut": 0}},
            "sft_parse_fraction": 0.7, "sft_parse_n": 63, "sft_stopped": 50, "sft_im_end": 48,
            "sft_parse_and_im_end_fraction": 39 / 63, "sft_doctest_passed": 2, "sft_doctest_n": 9,
            "sft_repetition_penalty": 1.2, "sft_greedy_parse_and_im_end_fraction": 26 / 63, "sft_seed": 1337}


def test_one_parse_row_with_the_strict_figure():
    rows = sft_rows(_summary())
    parse_rows = [(k, v) for k, v in rows if "parse" in k]
    assert len(parse_rows) == 1
    label, value = parse_rows[0]
    assert "<|im_end|>" in label
    assert value.startswith("62% of 63 held-out prompts")
    assert f"within {SFT_EVAL_MAX_NEW_TOKENS} tokens; 48 ended with <|im_end|>" in value
    # the decoding policy, the plain greedy figure beside it, and that it is one seed's run
    assert "(greedy, repetition penalty 1.2," in value and "plain greedy 41%" in value
    assert "one run, SFT seed 1337" in value
    assert len({k for k, _ in rows}) == len(rows)


def test_no_sft_rows_without_sft():
    assert sft_rows({}) == []
