"""Results as files: JSON, JUnit, the Buildkite annotation and pipelines, and the provisional
records of a stopped run."""
