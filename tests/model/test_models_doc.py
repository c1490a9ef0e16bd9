"""docs/models.md lists exactly the architectures the registry serves."""

from __future__ import annotations

import re
from pathlib import Path

from iterserve.model.model_config import SUPPORTED_ARCHITECTURES
from iterserve.model.models import MODEL_REGISTRY

DOC = Path(__file__).resolve().parents[2] / "docs" / "models.md"


def test_models_doc_table_matches_the_registry():
    rows = re.findall(r"^\| `(\w+)` \| `models/(\w+)\.py` \|", DOC.read_text(), re.MULTILINE)
    assert rows, "no table rows found in docs/models.md"
    assert [arch for arch, _ in rows] == list(MODEL_REGISTRY)
    assert {arch: module for arch, module in rows} == {
        arch: module for arch, (module, _) in MODEL_REGISTRY.items()}
    assert set(SUPPORTED_ARCHITECTURES) == set(MODEL_REGISTRY)
