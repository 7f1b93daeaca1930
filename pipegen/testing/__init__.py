"""Test helpers shipped with pipegen (tiny models, fakes). Never imported by production code paths."""
