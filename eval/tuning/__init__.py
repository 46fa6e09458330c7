"""Tuning and calibrating methods for a model: ``vtprune tune`` (:mod:`.tune`, search spaces in :mod:`.spaces`)
and ``vtprune calibrate`` (:mod:`.calibrate_cli`: the debias trend in :mod:`.calibrate`, PrefixKV profiles in
:mod:`.calibrate_kv`)."""
