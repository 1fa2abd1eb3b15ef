"""The models this node serves and how they come and go: resolving a model's files (sources,
local paths), loading and recovering it (registry), one loaded model as the HTTP process sees it
(served_model, frontend), the node's devices (discovery), the first engine spawned early, and
ranks that span hosts (multinode)."""
