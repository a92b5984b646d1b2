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


def test_the_summary_shows_the_evaluation_suite():
    from lmforge.stages.speedrun import format_summary

    s = {"parameters": 10, "non_embedding_parameters": 5, "tokens_trained": 100, "tokens_per_s": 10.0,
         "stage_seconds": {"pretrain": 1.0}, "val_loss": 3.0, "val_perplexity": 20.0, "val_bits_per_byte": 1.5,
         "xz_bits_per_byte": 2.0, "loss_plot": None, "checkpoint": "ckpt", "samples": [],
         "suite": {"suite": 0.21, "tasks": {"next_line": {"kind": "choice", "n": 200, "accuracy": 0.59,
                                                          "accuracy_sum": 0.44, "baseline": 0.25, "centred": 0.45,
                                                          "interval": [0.52, 0.66]}}}}
    text = format_summary(s)
    assert "| evaluation suite (mean centred score)" in text and "+0.210 (0 = chance" in text
    assert "| next_line | choice | 200 | 59.0% (sum: 44.0%) | [52.0%, 66.0%] | 25.0% | +0.450 |" in text
    assert "evaluation suite" not in format_summary({**s, "suite": None})
