"""The modules of `recipes/regime_study.py`: `config` (its settings), `base` (the plateaued base), `study`
(Shakespeare, the regime's figures, the look-ahead's pick, the oracle sweep), `summary` (study.json and study.md).
Like every recipe they use hf_depthgrow's public API only."""
