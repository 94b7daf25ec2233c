"""Data: how a data file becomes batches of token ids.

    files -> rows -> examples -> batches

Modules, in reading order:
    files    which file formats are read (JSONL, JSON, CSV / TSV, Parquet, Arrow, a folder) and where
             each row came from (`file:line`, `file:row N`)
    rows     one row: its keys under the user's names (`fields`), typed access, the row shapes people's
             data comes in turned into the few minitrain trains on
    readers  rows -> token-id examples (SFT, seq2seq, preference pairs, unpaired rows), truncation,
             `hold_out`
    batcher  which examples form each micro-batch: seeded, length-grouped, resumable exactly
    collate  examples -> padded batch tensors; `IGNORE_INDEX`, the label that takes no loss
    images   image files -> the pixel values (and patch grids) a vision tower reads, as the checkpoint's
             image processor (Qwen2-VL's, Gemma 3's), the placeholder tokens that stand for them; image
             rows' chats, each batch's images decoded when it is collated
    videos   videos given as frame files -> the pixel values, grids and placeholder tokens of Qwen2.5-VL's and
             Qwen3-VL's video processors; video parts of SFT rows
    prefetch the next micro-batch collated (its images decoded) in a background thread while one trains
    packing  a micro-batch's sequences packed into as few rows as fit
    store    the token store: a split's examples as flat arrays on disk, read through a memory map
    store_build  the store built once (fingerprint, lock, parallel workers, atomic rename), or found in the cache
    store_cache  the cache folder: each store's last use, old stores removed, `minitrain cache`
"""
