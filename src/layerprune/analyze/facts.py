"""A small offline factual-recall set (country -> capital), shipped with the code so it needs no download."""

from __future__ import annotations

CAPITALS: tuple[tuple[str, str], ...] = (
    ("France", "Paris"), ("Germany", "Berlin"), ("Italy", "Rome"), ("Spain", "Madrid"), ("Portugal", "Lisbon"),
    ("Japan", "Tokyo"), ("China", "Beijing"), ("Russia", "Moscow"), ("Egypt", "Cairo"), ("Greece", "Athens"),
    ("Austria", "Vienna"), ("Poland", "Warsaw"), ("Norway", "Oslo"), ("Sweden", "Stockholm"),
    ("Finland", "Helsinki"), ("Denmark", "Copenhagen"), ("Ireland", "Dublin"), ("Hungary", "Budapest"),
    ("Czech Republic", "Prague"), ("Belgium", "Brussels"), ("Netherlands", "Amsterdam"), ("Turkey", "Ankara"),
    ("Iran", "Tehran"), ("Iraq", "Baghdad"), ("India", "New Delhi"), ("Pakistan", "Islamabad"),
    ("Thailand", "Bangkok"), ("Vietnam", "Hanoi"), ("Indonesia", "Jakarta"), ("Philippines", "Manila"),
    ("South Korea", "Seoul"), ("Kenya", "Nairobi"), ("Nigeria", "Abuja"), ("Ethiopia", "Addis Ababa"),
    ("Morocco", "Rabat"), ("Argentina", "Buenos Aires"), ("Chile", "Santiago"), ("Peru", "Lima"),
    ("Colombia", "Bogota"), ("Venezuela", "Caracas"), ("Cuba", "Havana"), ("Mexico", "Mexico City"),
    ("Canada", "Ottawa"), ("Australia", "Canberra"), ("New Zealand", "Wellington"), ("Brazil", "Brasilia"),
    ("Ukraine", "Kyiv"), ("Romania", "Bucharest"), ("Bulgaria", "Sofia"), ("Serbia", "Belgrade"),
    ("Croatia", "Zagreb"), ("Switzerland", "Bern"), ("Iceland", "Reykjavik"), ("Saudi Arabia", "Riyadh"),
    ("Israel", "Jerusalem"), ("Syria", "Damascus"), ("Lebanon", "Beirut"), ("Afghanistan", "Kabul"),
    ("Nepal", "Kathmandu"), ("Bangladesh", "Dhaka"), ("Malaysia", "Kuala Lumpur"), ("Singapore", "Singapore"),
    ("Ghana", "Accra"), ("Senegal", "Dakar"), ("Algeria", "Algiers"), ("Tunisia", "Tunis"),
    ("Libya", "Tripoli"), ("Sudan", "Khartoum"), ("Uganda", "Kampala"), ("Zimbabwe", "Harare"),
    ("Jamaica", "Kingston"), ("Ecuador", "Quito"), ("Bolivia", "La Paz"), ("Uruguay", "Montevideo"),
    ("Paraguay", "Asuncion"), ("Estonia", "Tallinn"), ("Latvia", "Riga"), ("Lithuania", "Vilnius"),
)
