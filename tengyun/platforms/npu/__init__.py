"""The Ascend NPU platform (platform.py) and its torch_npu kernels (kernels/)."""
