"""The model folder on disk: its manifest (format, validation), the hashes and atomic writes of artifacts.py,
confined paths, temporary folders, image files, and relayout (the stored weights rewritten for a target)."""
