"""The plan as PyTorch code: FSDP1 and FSDP2 snippets (fsdp.py) and the lines every dialect shares for the
techniques (techniques.py), the device mesh (mesh.py) and the pipeline schedule (pipeline.py)."""
