"""What a checkpoint is on disk, wherever the disk is: durable writes (`storage`), the manifest
written last that makes a folder exist (`manifest`), checkpoint folders found, fetched and
published (`checkpoint`), the training loop's hard-linked snapshot of a save (`snapshot`), and the
run's journal, events.jsonl (`journal`). Nothing here knows about Google Drive or ranks."""
