from setuptools import Extension, setup

# Optional: built where a C compiler and libjpeg-turbo's headers are found; fastdata works
# without it (fastdata/images/window.py)
setup(
    ext_modules=[
        Extension(
            "fastdata.images._jpegwindow",
            sources=["fastdata/images/_jpegwindow.c"],
            libraries=["jpeg"],
            optional=True,
        )
    ]
)
