"""Reading user media safely: images (:mod:`.images`: EXIF orientation, 16-bit, size caps, clear errors) and
video (:mod:`.video`, :mod:`.video_io`: bounded decoding, frame sampling, rotation). An application layer:
nothing in vtprune's core imports it."""
