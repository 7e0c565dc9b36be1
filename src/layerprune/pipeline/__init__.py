"""Runs and studies (above the stages): `layerprune run`'s pipeline, the studies, their reports.

Importing it registers `variant:NAME` model specs (layerprune.posttrain), so a run or study recipe may name a
post-trained variant wherever it names a model."""

import layerprune.posttrain  # noqa: F401
