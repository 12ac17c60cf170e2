"""Other loaders' APIs over ramjet, so training scripts migrate by changing one import line
(``docs/migrate.md``): :mod:`ramjet.compat.mosaicml` for MosaicML Streaming."""
