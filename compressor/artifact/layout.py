"""The names of an artifact's own entries, which the writer, the reader, the tokenizer store and the ownership
check (what ``--overwrite`` may replace) all use; this module imports nothing, so they need not import each
other for them."""

MARKER = "unionsparse"  # root attribute, True on every unionsparse store
MANIFEST = "unionsparse_manifest.json"  # the file list and digests beside the root zarr.json
TOKENIZER_DIR = "tokenizer"  # the stored tokenizer's folder of plain files
