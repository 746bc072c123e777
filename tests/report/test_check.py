import base64

from reporthelpers import image, png

from pipeline.report.check import check_html


def test_check_html__reports_missing_file_and_bad_data(tmp_path):
    (tmp_path / "figures").mkdir()
    (tmp_path / "figures/ok.png").write_bytes(b"x")
    good = base64.b64encode(png(image(1))).decode()
    (tmp_path / "r.html").write_text(
        f'<html><body><img src="figures/ok.png"><img src="figures/missing.png">'
        f'<img src="data:image/png;base64,{good}"><img src="data:image/png;base64,!!!">'
        f'<img src="data:image/png;base64,{base64.b64encode(b"GIF89a").decode()}">'
        f'<img src="https://example.org/x.png"><img alt="no src"></body></html>'
    )
    problems = check_html(tmp_path / "r.html")
    assert len(problems) == 5, problems
    assert problems[0].startswith("img #2:") and "missing.png" in problems[0]
    assert problems[1].startswith("img #4:") and "base64" in problems[1]
    assert problems[2].startswith("img #5:") and "not a PNG" in problems[2]
    assert problems[3].startswith("img #6:") and "self-contained" in problems[3]
    assert problems[4] == "img #7: no src"
    assert check_html(tmp_path / "absent.html") == [
        f"{tmp_path / 'absent.html'}: file does not exist"
    ]


def test_check_html__data_uri_edge_cases(tmp_path):
    (tmp_path / "r.html").write_text(
        '<img src="data:image/png;base64,"><img src="data:text/plain,hello">'
        '<img src="data:image/png">'
    )
    assert check_html(tmp_path / "r.html") == [
        "img #1: data URI is empty",
        "img #3: data URI without ','",
    ]
