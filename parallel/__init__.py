"""Device mesh and degrees, document-masked attention kernels, registration into transformers."""
