"""The manifest of a model folder: its schema checks (checks.py) and its typed records (model.py).

Read with `artifacts.read_manifest` (validated, then typed), written with `artifacts.write_manifest` (the one
writer, atomic): every other module reads attributes, never string keys (tests/house/test_house_rules.py).
"""

from .checks import (DEFAULT_FAMILY, FORMAT_VERSION, SUPPORTED_VERSIONS, ManifestError, check_precision_schedule,
                     check_recommended, check_relative, check_scheduler_config, confined, validate_manifest)
from .model import (Component, Manifest, PipelineInfo, PrecisionScheduleRecord, Recommended, TensorSpec, as_dict,
                    manifest_bytes, typed)

__all__ = ["DEFAULT_FAMILY", "FORMAT_VERSION", "SUPPORTED_VERSIONS", "Component", "Manifest", "ManifestError",
           "PipelineInfo", "PrecisionScheduleRecord", "Recommended", "TensorSpec", "as_dict",
           "check_precision_schedule", "check_recommended", "check_relative", "check_scheduler_config", "confined", "manifest_bytes", "typed",
           "validate_manifest"]
