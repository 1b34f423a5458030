"""What runs inside vLLM's interpreter: the plugin (vLLM's ``vllm.general_plugins``), the fault-injecting
connector (``kv_connector_module_path``), the perf driver and the link probe (``python -m``). Every
module here imports only the standard library, ``core`` and this package (an import-linter contract):
it runs in vLLM's processes, where the harness's other layers have no business."""
