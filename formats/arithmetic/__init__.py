"""The arithmetic contract every layer shares: code ranges, the weight and activation quantization rules,
and the outlier side matrix's layout. Compress, the kernels' CPU references, verify and the runtime all
call these functions, so they agree bit for bit (docs/quantization.md)."""
