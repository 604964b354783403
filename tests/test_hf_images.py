"""to_rgb: what a vision processor is given, for every kind of image Pillow opens from the
formats a chat may carry, checked pixel by pixel (real PNG and JPEG bytes, reopened)."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from solar_host.servers.hf_images import to_rgb

WHITE = (255, 255, 255)


def reopened(img: Image.Image, fmt: str = "PNG", **save: object) -> Image.Image:
    """`img` as a server receives it: saved to bytes in `fmt`, then opened from them."""
    buf = io.BytesIO()
    img.save(buf, format=fmt, **save)
    return Image.open(io.BytesIO(buf.getvalue()))


def near(got: tuple[int, ...], want: tuple[int, ...], tol: int = 0) -> bool:
    return all(abs(g - w) <= tol for g, w in zip(got, want, strict=True))


@pytest.mark.parametrize(("value", "grey"), [(0, 0), (32768, 128), (65535, 255), (4096, 16)])
def test_16_bit_grey_is_scaled_not_clipped(value: int, grey: int) -> None:
    """A 16-bit grayscale PNG opens as I;16; convert("RGB") clipped it (mid-grey was white)."""
    img = reopened(Image.fromarray(np.full((8, 8), value, dtype=np.uint16)))
    assert img.mode == "I;16"
    out = to_rgb(img)
    assert out.mode == "RGB" and out.size == (8, 8)
    assert out.getpixel((3, 3)) == (grey, grey, grey)


def test_32_bit_and_float_grey_are_scaled_from_their_range() -> None:
    # I holding 16-bit values (how older Pillow opens a 16-bit PNG): as 16 bits.
    sixteen = Image.fromarray(np.full((4, 4), 32768, dtype=np.int32))
    assert sixteen.mode == "I" and to_rgb(sixteen).getpixel((0, 0)) == (128, 128, 128)
    # I past 16 bits: from its own maximum.
    wide = np.zeros((4, 4), dtype=np.int32)
    wide[0, 0], wide[1, 1] = 1_000_000, 400_000
    out = to_rgb(Image.fromarray(wide))
    assert out.getpixel((0, 0)) == WHITE and out.getpixel((1, 1)) == (102, 102, 102)
    assert out.getpixel((2, 2)) == (0, 0, 0)
    # F in 0..1: that range.
    assert to_rgb(Image.new("F", (4, 4), 0.5)).getpixel((0, 0)) == (128, 128, 128)


def test_exif_orientation_is_applied() -> None:
    """A 64x32 JPEG, blue left half and red right, marked 'rotate 90 clockwise to show'
    (orientation 6, what phones write): shown 32x64, blue on top."""
    img = Image.new("RGB", (64, 32), (255, 0, 0))
    img.paste((0, 0, 255), (0, 0, 32, 32))
    exif = Image.Exif()
    exif[0x0112] = 6
    stored = reopened(img, "JPEG", exif=exif.tobytes(), quality=95)
    assert stored.size == (64, 32)
    out = to_rgb(stored)
    assert out.size == (32, 64)
    assert near(out.getpixel((16, 8)), (0, 0, 255), tol=8)
    assert near(out.getpixel((16, 56)), (255, 0, 0), tol=8)


def test_transparency_is_composited_onto_white() -> None:
    # RGBA: transparent black shows white, half-transparent red is pink.
    rgba = Image.new("RGBA", (8, 8), (0, 0, 0, 0))
    rgba.paste((255, 0, 0, 128), (0, 0, 4, 8))
    out = to_rgb(reopened(rgba))
    assert out.mode == "RGB"
    assert out.getpixel((6, 4)) == WHITE
    assert near(out.getpixel((1, 4)), (255, 127, 127), tol=1)
    # LA: transparent black, opaque grey.
    la = Image.new("LA", (8, 8), (0, 0))
    la.paste((100, 255), (0, 0, 4, 8))
    out = to_rgb(reopened(la))
    assert out.getpixel((6, 4)) == WHITE and out.getpixel((1, 4)) == (100, 100, 100)
    # P with a transparent palette index (PNG and GIF).
    for fmt in ("PNG", "GIF"):
        p = Image.new("P", (8, 8), 0)
        p.putpalette([0, 0, 0, 10, 200, 30] + [0] * 762)
        p.paste(1, (0, 0, 4, 8))
        out = to_rgb(reopened(p, fmt, transparency=0))
        assert out.getpixel((6, 4)) == WHITE, fmt
        assert out.getpixel((1, 4)) == (10, 200, 30), fmt
    # RGB with a transparent colour (PNG tRNS).
    rgb = Image.new("RGB", (8, 8), (1, 2, 3))
    rgb.paste((40, 50, 60), (0, 0, 4, 8))
    out = to_rgb(reopened(rgb, transparency=(1, 2, 3)))
    assert out.getpixel((6, 4)) == WHITE and out.getpixel((1, 4)) == (40, 50, 60)


def test_plain_modes_convert_as_before() -> None:
    assert to_rgb(reopened(Image.new("RGB", (4, 4), (9, 99, 199)))).getpixel((0, 0)) == (
        9,
        99,
        199,
    )
    assert to_rgb(reopened(Image.new("L", (4, 4), 77))).getpixel((0, 0)) == (77, 77, 77)
    assert to_rgb(reopened(Image.new("1", (4, 4), 1))).getpixel((0, 0)) == WHITE
    cmyk = to_rgb(reopened(Image.new("CMYK", (8, 8), (0, 0, 0, 0)), "JPEG"))
    assert cmyk.mode == "RGB" and near(cmyk.getpixel((4, 4)), WHITE, tol=2)


def test_a_broken_exif_block_does_not_fail_the_image() -> None:
    img = reopened(Image.new("RGB", (8, 4), (0, 128, 0)), "JPEG")
    img.info["exif"] = b"Exif\x00\x00garbage"
    out = to_rgb(img)
    assert out.size == (8, 4) and near(out.getpixel((2, 2)), (0, 128, 0), tol=4)
